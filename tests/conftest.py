"""Shared fixtures: a real Ray cluster per test module, always started here with its own address.

Never a bare ``ray.init()``: that can join a stale cluster recorded in Ray's temp dir.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

# Small intervals so failure tests finish in seconds; each may be overridden from outside.
os.environ.setdefault("ELASTIC_HEARTBEAT_INTERVAL_S", "0.5")
os.environ.setdefault("ELASTIC_HEARTBEAT_TIMEOUT_S", "5")
os.environ.setdefault("ELASTIC_COLLECTIVE_TIMEOUT_S", "20")
os.environ.setdefault("ELASTIC_PLACEMENT_TIMEOUT_S", "20")

# No AWS credentials of this machine's own, in the suite's processes or the clusters it starts
# (they inherit this environment): the tests that put S3 credentials in the driver alone
# (helpers.s3_with_credentials_in_this_process_only) skipped wherever botocore found some (an EC2
# instance role, ~/.aws/credentials on a CI runner), and asked the instance metadata service
# (1-2 s) where there was none. The tests' S3 is moto on loopback, with its own keys.
for _name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
              "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
              "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
              "AWS_CONTAINER_AUTHORIZATION_TOKEN"):
    os.environ.pop(_name, None)
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.environ["AWS_CONFIG_FILE"] = os.devnull


_PATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")])
# Workers import the test helpers and examples from this checkout. Set in the environment the
# raylets inherit, rather than as a runtime_env, so worker processes start without a runtime-env
# setup step (seconds per actor on a 2-core machine).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_PATH, os.environ.get("PYTHONPATH", "")) if p)


# The heaviest modules first (longest processing time first): ``make test`` hands whole modules
# to two pytest processes as each frees up, in collection order, so a heavy module collected last
# (alphabetically, test_recovery_e2e or test_worker_group) ran alone at the end while the other
# process sat idle. Measured on the 2-vCPU VM; a module not named keeps its place after these.
HEAVY_FIRST = ("test_checkpoint_e2e.py", "test_first_n_e2e.py", "test_recovery_e2e.py", "test_node_loss_e2e.py",
               "test_controller.py", "test_jobs_e2e.py", "test_dp_e2e.py", "test_buffers_e2e.py",
               "test_placement_e2e.py", "test_checkpoint_agent.py", "test_cli.py", "test_checkpoint_store.py",
               "test_example.py", "test_worker_group.py", "test_worker_ddp.py", "test_signals.py")


def pytest_collection_modifyitems(config, items):
    """Order modules by ``HEAVY_FIRST``; a stable sort keeps each module's tests together and in
    their own order (module-scoped fixtures, one cluster per module, rely on both)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


def worker_env() -> dict:
    """Extra runtime_env for ray.init; empty because the environment already carries the path."""
    return {}


def start_cluster(num_nodes: int = 1, cpus_per_node: int = 8, num_gpus: int | None = None):
    import ray
    from ray.cluster_utils import Cluster

    head = {"num_cpus": cpus_per_node, "include_dashboard": False}
    if num_gpus is not None:
        head["num_gpus"] = num_gpus
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:  # a cluster that started but could not be joined is not left running for later modules
        for _ in range(num_nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def stop_cluster(cluster) -> None:
    import ray

    try:
        ray.shutdown()
    finally:
        cluster.shutdown()


_shared: dict = {"cluster": None}


def release_shared_cluster() -> None:
    """Stop the shared single-node cluster (a module about to start its own calls this first:
    one driver connects to one cluster at a time)."""
    if _shared["cluster"] is not None:
        stop_cluster(_shared["cluster"])
        _shared["cluster"] = None


@pytest.fixture(scope="module")
def ray_cluster():
    """One single-node cluster shared by every module that needs nothing special.

    Starting and stopping a cluster costs ~8 s on a 2-core machine; the modules that use this one
    only create and tear down their own named actors, so they can share it. It is stopped at
    the end of the session, or earlier when a module needs a cluster of its own. Under
    pytest-xdist (``make test`` runs two processes, whole modules each) every process has its
    own: clusters never share a driver, and each names its own address.
    """
    if _shared["cluster"] is None:
        _shared["cluster"] = start_cluster()
    return _shared["cluster"]


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_cluster():
    yield
    release_shared_cluster()


@pytest.fixture(scope="module")
def moto_s3():
    """A real S3-compatible endpoint on 127.0.0.1 (moto's threaded server, port 0)."""
    from elastic.checkpoint.testing import MotoS3

    server = MotoS3().start()
    yield server
    server.stop()


@pytest.fixture
def rayless_controller(monkeypatch):
    """Build real ``Controller`` objects with no Ray underneath: its runtime context is a stand-in,
    so the constructor starts or joins no cluster. For the controller's bookkeeping, with stand-in
    groups and ranks; ``rayless_controller(scaling=..., name=...)``."""
    import elastic
    from elastic import controller as controller_module
    from elastic.actors.worker import TrainingSpec

    def no_runtime():  # ray.get_runtime_context() outside an actor joins (or starts) a cluster
        raise RuntimeError("not in a Ray actor")

    monkeypatch.setattr(controller_module.ray, "get_runtime_context", no_runtime)
    # Another module's shared cluster (ray_cluster) may be connected in this process already.
    connected = controller_module.ray.is_initialized()
    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)

    def build(scaling=None, name="rayless", failure=None, global_batch_size=8, batch_schedule=None):
        c = controller_module.Controller(spec, scaling or elastic.ScalingConfig(num_workers=2),
                                         elastic.RunConfig(name=name), failure or elastic.FailureConfig(),
                                         global_batch_size=global_batch_size, batch_schedule=batch_schedule)
        assert controller_module.ray.is_initialized() == connected
        return c
    return build
