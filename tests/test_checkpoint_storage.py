"""Storage contract test: one set of checks run against file://, a plain path, memory:// and a real S3
endpoint (moto's server), plus validate() and credential redaction."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time

import pytest

from elastic.checkpoint.storage import (
    FileRefused,
    Redactor,
    RetryPolicy,
    Storage,
    StorageError,
    StorageUnavailable,
    redact_url,
    resolve_url,
    _reads_concurrently,
)
from elastic.checkpoint.testing import BACKENDS, TEST_SECRET, MotoS3, backend_url, clear_memory
from elastic.checkpoint.store import MANIFEST, CheckpointStore, step_dir
from elastic.config import ConfigError
from test_checkpoint_store import commit_tiny

FAST = RetryPolicy(attempts=3, base_s=0.01, max_s=0.05)


@pytest.fixture(params=BACKENDS + ("memory-host",))
def backend(request, tmp_path, monkeypatch):
    """Every backend, plus memory:// as a run's processes see it: through the run's MemoryHost
    actor (elastic/checkpoint/memory.py), with this test process in a rank's place."""
    if request.param == "memory-host":
        import ray

        from elastic.checkpoint import memory

        request.getfixturevalue("ray_cluster")
        monkeypatch.setattr(memory, "in_run_process", lambda: True)
        host = memory._start_host()
        yield backend_url("memory", str(tmp_path))
        ray.kill(host, no_restart=True)
        return
    moto = request.getfixturevalue("moto_s3") if request.param == "s3" else None
    url, options = backend_url(request.param, str(tmp_path), moto)
    yield url, options
    if request.param == "memory":
        clear_memory(url)


@pytest.fixture
def no_aws_env(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks: env, shared files, instance metadata."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# ---- contract ----------------------------------------------------------------------------------
def test_write_read_list_delete(backend):
    url, options = backend
    storage = Storage(url, options, retry=FAST)
    storage.validate()
    assert storage.list_dir("") == []
    storage.write_bytes("step-000000001/a.bin", b"alpha")
    storage.write_bytes("step-000000001/b.bin", b"")
    storage.write_bytes("step-000000002/a.bin", b"x" * 1000)
    assert storage.read_bytes("step-000000001/a.bin") == b"alpha"
    assert storage.read_bytes("step-000000001/b.bin") == b""
    assert storage.exists("step-000000002/a.bin")
    assert not storage.exists("step-000000002/missing.bin")
    assert storage.list_dir("") == ["step-000000001", "step-000000002"]
    detail = storage.list_dir("step-000000001", detail=True)
    assert [(e["name"], e["size"]) for e in detail] == [("a.bin", 5), ("b.bin", 0)]
    assert storage.list_dir("no-such-dir") == []

    storage.write_bytes("step-000000001/a.bin", b"overwritten")
    assert storage.read_bytes("step-000000001/a.bin") == b"overwritten"
    # With a size on record, never more than one byte past it: a grown file shows without being
    # read whole; a shorter or empty one comes back as it is.
    assert storage.read_bytes("step-000000002/a.bin", size=10) == b"x" * 11
    assert storage.read_bytes("step-000000002/a.bin", size=1000) == b"x" * 1000
    assert storage.read_bytes("step-000000002/a.bin", size=5000) == b"x" * 1000
    assert storage.read_bytes("step-000000001/b.bin", size=0) == b""
    assert storage.read_bytes("step-000000001/b.bin", size=3) == b""
    assert storage.read_bytes("step-000000002/a.bin", size=0) == b"x"  # an empty record: not read whole

    storage.delete("step-000000001/b.bin")
    storage.delete("step-000000001/b.bin")  # missing is fine
    assert storage.list_dir("step-000000001") == ["a.bin"]
    storage.delete_tree("step-000000001")
    storage.delete_tree("step-000000001")  # missing is fine
    assert storage.list_dir("") == ["step-000000002"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("step-000000001/a.bin")
    with pytest.raises(ValueError, match="refusing to delete the storage root"):
        storage.delete_tree("")


def test_two_instances_see_each_others_writes(backend):
    """Workers and the controller are different processes: no stale listing caches."""
    url, options = backend
    a, b = Storage(url, options, retry=FAST), Storage(url, options, retry=FAST)
    assert b.list_dir("") == []
    a.write_bytes("step-000000003/x", b"1")
    assert b.list_dir("") == ["step-000000003"]
    b.delete_tree("step-000000003")
    assert a.list_dir("") == []


def test_storage_pickles_without_filesystem(backend):
    import pickle

    url, options = backend
    storage = Storage(url, options, retry=FAST)
    storage.write_bytes("f", b"data")
    clone = pickle.loads(pickle.dumps(storage))
    assert clone._fs is None
    assert clone.read_bytes("f") == b"data"


def test_a_file_that_landed_after_its_directory_was_listed_reads_on_s3(moto_s3):
    # s3fs answered the size of a shard larger than its block from the listing cache: a listing
    # of the step taken before the shard landed (elastic checkpoints on a live run) made a
    # committed shard FileNotFoundError, and the step read as corrupt.
    import fsspec

    bucket = moto_s3.create_bucket()
    storage = Storage(f"s3://{bucket}/run", {**moto_s3.storage_options(), "default_block_size": 1024})
    storage.write_bytes("step-000000001/a", b"x")
    assert storage.list_dir("step-000000001") == ["a"]
    other = fsspec.filesystem("s3", skip_instance_cache=True, **moto_s3.storage_options())
    other.pipe_file(f"{bucket}/run/step-000000001/b", b"y" * 2048)  # another process's write
    assert storage.read_bytes("step-000000001/b", size=2048) == b"y" * 2048


# ---- retries against a real endpoint that goes away and comes back -----------------------------
def test_transient_errors_are_retried_until_the_endpoint_returns():
    server = MotoS3().start()
    restart = threading.Timer(0.4, server.start)
    try:
        bucket = server.create_bucket()
        storage = Storage(f"s3://{bucket}/run", server.storage_options(),
                          retry=RetryPolicy(attempts=30, base_s=0.05, max_s=0.1))
        storage.write_bytes("before", b"1")
        server.stop()
        restart.start()
        t0 = time.monotonic()
        storage.write_bytes("during", b"2")  # fails until the server is back, then succeeds
        assert time.monotonic() - t0 >= 0.3
        restart.join()
        assert storage.read_bytes("before") == b"1"  # moto's backend kept the bucket across restarts
        assert storage.read_bytes("during") == b"2"
    finally:
        restart.cancel()  # a failure before it fired: it must not start the server after the stop below
        if restart.is_alive():
            restart.join()
        server.stop()


def test_a_restart_on_a_port_taken_meanwhile_fails_at_once():
    # moto's start() waited for its server thread with no timeout, and the thread died on the bind
    # error: an outage test whose port another process took meanwhile hung until pytest's timeout.
    import socket

    server = MotoS3().start()
    server.stop()
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        with pytest.raises(OSError, match=f"cannot start again on 127.0.0.1:{server.port}"):
            server.start()
        assert not server.running
    finally:
        squatter.close()
    assert server.start().running  # free again: it starts
    server.stop()


def test_retries_are_bounded_and_errors_redacted():
    server = MotoS3().start()
    bucket = server.create_bucket()
    options = server.storage_options()
    server.stop()
    storage = Storage(f"s3://{bucket}/run", options, retry=RetryPolicy(attempts=3, base_s=0.01, max_s=0.02))
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as info:
        storage.write_bytes("x", b"1")
    assert time.monotonic() - t0 < 10.0  # our 3 quick attempts, not botocore's own retries and timeouts
    assert "after 3 attempts" in str(info.value)
    assert TEST_SECRET not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_credentials_under_any_secret_looking_key_are_redacted_at_any_depth():
    """A connection string (Azure's holds AccountKey=...), an Authorization header and a
    (user, password) pair passed through."""
    from types import MappingProxyType

    options = {"connection_string": "DefaultEndpointsProtocol=https;AccountKey=c29tZWtleQ==",
               "client_kwargs": {"headers": {"Authorization": "Bearer eyJhbGciOi"}},
               "auth": ("alice", "s3cr3t-pass"), "endpoint_url": "http://127.0.0.1:9000",
               "config_kwargs": MappingProxyType({"session_token": "FwoGZXIvYXdzE"})}
    redact = Redactor(options)
    text = redact(f"failed with {options}")
    for secret in ("AccountKey=c29tZWtleQ==", "eyJhbGciOi", "alice", "s3cr3t-pass", "FwoGZXIvYXdzE"):
        assert secret not in text
    assert "http://127.0.0.1:9000" in text and "client_kwargs" in text


# ---- validate ----------------------------------------------------------------------------------
def test_validate_unknown_scheme():
    with pytest.raises(ConfigError, match=r"unknown URL scheme 'foo://'.*file://, memory://, s3://"):
        Storage("foo://x/y").validate()


@pytest.mark.parametrize("url", ["tar://x", "zip://x", "dir://x"])
def test_validate_a_url_no_filesystem_can_open_is_a_config_error(tmp_path, monkeypatch, url):
    # Raw IsADirectoryError / AttributeError out of fsspec before; the message names the setting.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"RunConfig.storage=.* cannot be opened as a \w+:// filesystem"):
        Storage(url).validate()


def test_validate_s3_without_credentials_is_fast_and_clear(no_aws_env, moto_s3):
    bucket = moto_s3.create_bucket()
    options = {"anon": False, "endpoint_url": moto_s3.endpoint_url}
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="no AWS credentials found") as info:
        Storage(f"s3://{bucket}/run", options).validate()
    assert time.monotonic() - t0 < 5.0  # no wait on the instance metadata service; a loaded machine's client start
    assert "storage_options" in str(info.value)


def test_validate_s3_key_without_secret(no_aws_env, moto_s3):
    with pytest.raises(ConfigError, match=r"storage_options\['secret'\]"):
        Storage("s3://b/run", {"key": "AKIAEXAMPLE", "endpoint_url": moto_s3.endpoint_url}).validate()


def test_validate_s3_missing_bucket_never_shows_the_secret(moto_s3):
    options = moto_s3.storage_options()
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-elastic' does not exist") as info:
        Storage("s3://no-such-bucket-elastic/run", options, retry=FAST).validate()
    assert TEST_SECRET not in str(info.value)


def test_validate_s3_unreachable_endpoint_is_bounded():
    server = MotoS3().start()
    options = server.storage_options()
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="cannot reach bucket") as info:
        Storage("s3://some-bucket/run", options, retry=FAST).validate()
    assert time.monotonic() - t0 < 10.0  # our 3 quick attempts, not botocore's own retries and timeouts
    assert TEST_SECRET not in str(info.value)


def test_validate_local_path_that_cannot_be_a_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="not writable"):
        Storage(f"{blocker}/run", retry=FAST).validate()


def test_validate_says_storage_that_does_not_answer_is_down_not_refusing(tmp_path, monkeypatch):
    # Transient errors that outlasted the retries (NFS's EIO, S3's SlowDown) were told as "not
    # writable: ... Check the path, permissions and RunConfig.storage_options" for an outage.
    def eio(self, rel, data):
        raise OSError(errno.EIO, "Input/output error (test)")

    monkeypatch.setattr(Storage, "_probe_write", eio)
    with pytest.raises(ConfigError) as info:
        Storage(f"file://{tmp_path}", retry=FAST).validate()
    text = str(info.value)
    assert "RunConfig.storage=" in text and "did not answer" in text and "start again once it answers" in text
    assert "permissions" not in text and "not writable" not in text


def test_a_probe_whose_write_failed_is_not_deleted_with_retries(tmp_path, monkeypatch, caplog):
    # The probe's delete was retried in full after a write that had failed from an outage: on an
    # endpoint that drops packets each try waits out the connect timeout, so a node's start
    # waited twice as long. Not asked after an outage; one try after a refusal.
    storage = Storage(f"file://{tmp_path}", retry=FAST)
    fs, _ = storage._filesystem()
    deletes, writes = [], []

    def rm_file(path):
        deletes.append(path)
        raise OSError(errno.EIO, "Input/output error (test)")

    def write(error):
        def probe_write(self, rel, data):
            writes.append(rel)
            raise error
        return probe_write

    monkeypatch.setattr(fs, "rm_file", rm_file)
    monkeypatch.setattr(Storage, "_probe_write", write(OSError(errno.EIO, "Input/output error (test)")))
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.storage"):
        storage.check_here()  # an outage: logged
    assert "did not answer a probe write" in caplog.text
    assert len(writes) == 2 and deletes == []  # the write retried, the delete never asked
    with pytest.raises(ConfigError):
        storage.validate()
    assert len(writes) == 4 and deletes == []
    monkeypatch.setattr(Storage, "_probe_write", write(PermissionError(errno.EACCES, "denied (test)")))
    with pytest.raises(ConfigError, match="not writable from here"):
        storage.check_here()
    assert len(deletes) == 1  # once, though it failed transiently


def test_validate_leaves_no_probe_behind(backend):
    url, options = backend
    storage = Storage(url, options, retry=FAST)
    storage.validate()
    assert storage.list_dir("") == []


def test_check_here_refuses_what_the_storage_refuses_and_lets_an_outage_pass(no_aws_env, moto_s3, tmp_path, caplog,
                                                                              monkeypatch):
    """``check_here`` runs in the controller, the node agents and the ranks at a run's start:
    a refusal is a ConfigError; an outage a warning (the writes retry and report it)."""
    from elastic.checkpoint import storage as storage_module

    monkeypatch.setattr(storage_module, "_CREDENTIALS_RETRY", RetryPolicy(attempts=3, base_s=0.0, max_s=0.0))
    bucket = moto_s3.create_bucket()
    with pytest.raises(ConfigError, match="no AWS credentials found"):
        Storage(f"s3://{bucket}/run", {"endpoint_url": moto_s3.endpoint_url}, retry=FAST).check_here()
    with pytest.raises(ConfigError, match="not writable from here"):
        Storage("s3://no-such-bucket-elastic/run", moto_s3.storage_options(), retry=FAST).check_here()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="not writable from here"):
        Storage(f"{blocker}/run", retry=FAST).check_here()
    storage = Storage(f"s3://{bucket}/run", moto_s3.storage_options(), retry=FAST)
    storage.check_here()
    assert storage.list_dir("") == []  # the probe is gone
    down = MotoS3().start()
    options = down.storage_options()
    down.stop()
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.storage"):
        Storage("s3://some-bucket/run", options, retry=FAST).check_here()
    assert any("did not answer a probe write" in r.getMessage() for r in caplog.records)
    assert TEST_SECRET not in caplog.text


def test_a_credentials_lookup_that_misses_once_at_a_nodes_start_is_looked_up_again(no_aws_env, moto_s3, monkeypatch):
    # botocore answers a lookup that timed out or was throttled (the instance-metadata endpoint,
    # a node's many processes asking at once) with None, as if there were no credentials. The
    # node's check looked once, and such a blip at a run's start ended it as "no AWS credentials
    # found", where mid-run the same miss is looked up again. The driver's check stays strict.
    import botocore.session

    from elastic.checkpoint import storage as storage_module

    monkeypatch.setattr(storage_module, "_CREDENTIALS_RETRY", RetryPolicy(attempts=4, base_s=0.0, max_s=0.0),
                        raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # moto takes any key
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    real, lookups = botocore.session.Session.get_credentials, []

    def misses_once(self):
        lookups.append(1)
        return None if len(lookups) == 1 else real(self)

    monkeypatch.setattr(botocore.session.Session, "get_credentials", misses_once)
    storage = Storage(f"s3://{moto_s3.create_bucket()}/run", {"endpoint_url": moto_s3.endpoint_url}, retry=FAST)
    try:
        storage.check_here()
        assert len(lookups) >= 2 and storage.list_dir("") == []
        lookups.clear()
        with pytest.raises(ConfigError, match="no AWS credentials found"):
            storage.validate()
        assert lookups == [1]
    finally:  # fsspec keeps the filesystem, with these credentials, for the next test's same options
        storage._filesystem()[0].clear_instance_cache()


def test_a_nodes_credentials_check_ends_well_within_its_bound_when_each_lookup_is_slow(no_aws_env, monkeypatch):
    # On a node outside AWS whose instance-metadata address drops packets, each lookup takes ~2 s
    # and finds nothing. The patient check's deadline (10 s) was checked only before each sleep,
    # so its 4th lookup started near 9.5 s and the check took ~12 s: a rank writing checkpoints
    # in-process, its configure call given collective_timeout_s, was killed as hung instead of
    # reporting the ConfigError naming its node.
    import botocore.session

    from elastic.checkpoint import storage as storage_module

    now, starts = [0.0], []

    class FakeTime:
        """The module's clock: sleeps and lookups advance it, nothing waits."""

        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def monotonic():
            return now[0]

        @staticmethod
        def sleep(seconds):
            now[0] += seconds

    def slow_miss(self):
        starts.append(now[0])
        now[0] += 2.0
        return None

    monkeypatch.setattr(storage_module, "time", FakeTime())
    monkeypatch.setattr(storage_module, "_CREDENTIALS_RETRY", RetryPolicy(attempts=4, base_s=0.5, max_s=2.0))
    monkeypatch.setattr(botocore.session.Session, "get_credentials", slow_miss)
    with pytest.raises(ConfigError, match="no AWS credentials found"):
        Storage("s3://some-bucket/run", {}, retry=FAST).check_here()
    bound = storage_module._CREDENTIALS_PATIENCE_S
    assert bound <= 5.0
    # Looked up again after the first miss, and each lookup let start ended by the bound.
    assert len(starts) == 2, starts
    assert all(start + 2.0 <= bound for start in starts), starts
    assert now[0] <= bound


def test_missing_credentials_are_a_refusal_not_an_outage(no_aws_env, moto_s3):
    """botocore's NoCredentialsError (no key in storage_options, none in this process's
    environment) is the same on every try: before, it was retried and called an outage."""
    bucket = moto_s3.create_bucket()
    storage = Storage(f"s3://{bucket}/run", {"endpoint_url": moto_s3.endpoint_url}, retry=FAST)
    with pytest.raises(StorageError, match="NoCredentialsError") as err:
        storage.list_dir("")
    assert not isinstance(err.value, StorageUnavailable)



@pytest.mark.parametrize("code, transient", [
    ("IncompleteBody", True), ("BadDigest", True), ("TokenRefreshRequired", True),  # EINVAL in s3fs's table
    ("PermanentRedirect", False), ("NotImplemented", False),  # EREMCHG, ENOSYS: no refusal by errno
    ("InvalidArgument", False), ("SlowDown", True),  # as their errno says
])
def test_an_s3_error_is_retried_or_refused_by_its_code_not_only_its_errno(code, transient):
    """s3fs turns S3's error codes into errnos: a body cut short on the way (EINVAL) was a
    refusal that dropped a step's part for a blip, and a bucket in another region (EREMCHG) an
    outage retried for storage that will never take the write. The error as s3fs raises it, from
    botocore's own ClientError."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    storage = Storage("memory://classify", retry=FAST)
    calls = []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise translate_boto_error(ClientError({"Error": {"Code": code, "Message": "test"}}, "PutObject"))
        return "written"

    if transient:
        assert storage._call("write", "a.bin", fails_once) == "written" and len(calls) == 2
    else:
        with pytest.raises(StorageError) as err:
            storage._call("write", "a.bin", fails_once)
        assert not isinstance(err.value, StorageUnavailable) and len(calls) == 1


@pytest.mark.parametrize("name, kwargs", [
    ("ParamValidationError", {"report": "Invalid bucket name \"my bucket\""}),
    ("InvalidConfigError", {"error_msg": "bad setting"}),
    ("InvalidS3AddressingStyleError", {"s3_addressing_style": "sideways"}),
])
def test_botocores_own_checks_before_a_request_are_a_refusal_not_an_outage(name, kwargs):
    # botocore refuses a bucket named "my bucket" (ParamValidationError), or a setting it does
    # not know, before anything is sent, and s3fs passes the error through as it is: it was
    # retried, and the user was told the storage was down.
    import botocore.exceptions

    storage = Storage("memory://botocore-checks", retry=FAST)
    calls = []

    def refused():
        calls.append(1)
        raise getattr(botocore.exceptions, name)(**kwargs)

    with pytest.raises(StorageError, match=name) as err:
        storage._call("write", "a.bin", refused)
    assert not isinstance(err.value, StorageUnavailable) and calls == [1]


def test_credentials_that_appear_after_a_failed_lookup_are_used_by_the_next_call(no_aws_env, moto_s3, monkeypatch):
    """botocore looks credentials up once, when s3fs makes its client, and fsspec keeps that
    filesystem for the process: a rank whose first lookup failed (instance metadata throttled
    at start) refused every write for the rest of the run, and no step committed again. A
    Storage made later in the process (a rank makes one at every join and restore) took the
    same cached filesystem."""
    from elastic.checkpoint import storage as storage_module

    monkeypatch.setattr(storage_module, "_credentials_forgotten_at", -float("inf"))
    bucket = moto_s3.create_bucket()
    url, options = f"s3://{bucket}/run", {"endpoint_url": moto_s3.endpoint_url}
    storage = Storage(url, options, retry=FAST)
    with pytest.raises(StorageError, match="NoCredentialsError"):
        storage.write_bytes("a.bin", b"alpha")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # moto takes any key
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    later = Storage(url, options, retry=FAST)
    later.write_bytes("b.bin", b"beta")
    storage.write_bytes("a.bin", b"alpha")
    assert storage.read_bytes("b.bin") == b"beta" and later.read_bytes("a.bin") == b"alpha"


@pytest.mark.parametrize("code", ["ExpiredToken", "InvalidAccessKeyId", "TokenRefreshRequired"])
def test_credentials_gone_stale_are_looked_up_again(code, monkeypatch):
    """Expired temporary credentials (a token a sidecar rewrites in ~/.aws, static to botocore)
    and rotated keys: the filesystem, and its client holding them, were kept for the process,
    so no write succeeded again and no step committed for the rest of the run."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    from elastic.checkpoint import storage as storage_module

    cleared = []

    class CachedFs:
        @classmethod
        def clear_instance_cache(cls):
            cleared.append(cls)

    monkeypatch.setattr(storage_module, "_credentials_forgotten_at", -float("inf"))
    storage = Storage("memory://stale", retry=FAST)
    storage._fs = CachedFs()

    def refused():
        raise translate_boto_error(ClientError({"Error": {"Code": code, "Message": "test"}}, "PutObject"))

    with pytest.raises(StorageError):
        storage._call("write", "a.bin", refused)
    assert storage._fs is None and cleared == [CachedFs]


def test_a_bucket_whose_head_a_prefix_only_grant_refuses_validates(moto_s3, monkeypatch):
    """S3 refuses HEAD of a bucket (403) to a policy that lists only under a prefix, a shared
    bucket's usual grant, and answers 404 to anyone for one that does not exist: fit() refused
    such a run, blaming its endpoint, region and credentials."""
    bucket = moto_s3.create_bucket()
    storage = Storage(f"s3://{bucket}/team-a/run", moto_s3.storage_options(), retry=FAST)
    fs, _ = storage._filesystem()
    real = fs.call_s3

    def call_s3(method, *args, **kwargs):
        if method == "head_bucket":
            raise PermissionError("Forbidden")
        return real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "call_s3", call_s3)
    storage.validate()  # the probe under team-a/ decides, and it writes


# ---- redaction ---------------------------------------------------------------------------------
def test_location_and_messages_never_carry_credentials(moto_s3):
    options = moto_s3.storage_options()
    storage = Storage("s3://user:hunter2pass@bucket/run?X-Amz-Signature=abc", options)
    assert storage.location == "s3://***@bucket/run"
    assert "hunter2pass" not in repr(storage)
    assert TEST_SECRET not in storage.redact(f"boom {TEST_SECRET} and hunter2pass")
    redact = Redactor({"client_kwargs": {"aws_secret_access_key": "nested-secret-value"}, "token": "tok-123456"})
    assert redact("a nested-secret-value b tok-123456") == "a *** b ***"
    assert redact_url("https://u:p@host/x?sig=1") == "https://***@host/x"


def test_a_password_with_a_slash_never_shows(moto_s3):
    # AWS secret keys often hold a '/': the userinfo runs to the '@' all the same. Parsers split
    # such a URL at the '/' (s3fs takes "AKIAEXAMPLE:wJalr" for the bucket), so no piece shows.
    url = "s3://AKIAEXAMPLE:wJalr/XUtnFEMI+K7MDENG@bucket/p"
    storage = Storage(url, moto_s3.storage_options(), retry=RetryPolicy(attempts=1))
    # s3fs reads no credentials from the URL: refused before any request, the way to pass them named
    # (validate() went on to botocore, whose bucket-name error showed "AKIAEXAMPLE:wJalr").
    with pytest.raises(ConfigError, match=r"storage_options \(key, secret, token\)") as refused:
        storage.validate()
    with pytest.raises(ConfigError) as info:
        storage.read_bytes("step-000000001/manifest.json")
    assert storage.location == "s3://***@bucket/p"
    texts = [storage.location, repr(storage), storage.describe("step-000000001/x"), str(info.value), str(refused.value),
             storage.redact(f"GET {url}/x failed"), Redactor(None)(f"GET {url}/x failed"), redact_url(url)]
    for text in texts:
        assert "wJalr" not in text and "XUtnFEMI" not in text, text
    assert Redactor(None)(f"GET {url}/x failed") == "GET s3://***@bucket/p/x failed"
    # No ':' before the '@': a path, not userinfo.
    assert redact_url("s3://bucket/key@v1/x") == "s3://bucket/key@v1/x"
    assert Redactor(None)("s3://bucket/key@v1/x") == "s3://bucket/key@v1/x"


def test_a_url_in_a_message_loses_its_query_string_and_the_rest_stays():
    redact = Redactor(None)
    assert redact("GET 's3://b/k?X-Amz-Signature=abc&X-Amz-Credential=AKIA%2F1': 403. Why? (denied)") == \
        "GET 's3://b/k': 403. Why? (denied)"
    assert redact("https://u:p/q@host/x?sig=1 and https://host/y?token=2") == "https://***@host/x and https://host/y"


def test_resolve_url_makes_plain_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_url("ckpts") == f"{tmp_path}/ckpts"
    assert resolve_url("s3://b/p") == "s3://b/p"
    # Trailing slashes name the same directory: "s3://b/p//" + run put it under the key prefix "p//".
    assert resolve_url("s3://b/p/") == resolve_url("s3://b/p//") == "s3://b/p"
    assert resolve_url("s3://b//") == "s3://b"
    assert resolve_url("memory://x") == "memory://x"
    # file:// and local:// with a relative path: every process would resolve it against its own cwd
    assert resolve_url("file://ckpts") == f"file://{tmp_path}/ckpts"
    assert resolve_url("local://./ckpts") == f"local://{tmp_path}/ckpts"
    assert resolve_url("file:///abs/ckpts") == "file:///abs/ckpts"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_url("~/ckpts") == f"{tmp_path}/home/ckpts"  # not <cwd>/~/ckpts


@pytest.mark.parametrize("url, match", [
    ("s3:/bucket/prefix", "starts with 's3:' but not 's3://'"),
    ("s3:bucket", "starts with 's3:' but not 's3://'"),
    ("s3://", "names no bucket"),
    ("s3:///", "names no bucket"),
    ("gs://", "names no bucket"),
    ("az:///", "names no bucket"),
    ("abfs://", "names no bucket"),
    ("file://", "names no directory"),  # was the cwd of each process that opened it
    ("local://", "names no directory"),
    ("", "RunConfig.storage must be a non-empty string"),
    ("  ", "RunConfig.storage is empty"),
])
def test_a_mistyped_or_bucketless_url_is_refused_before_anything_is_written(tmp_path, monkeypatch, url, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match):
        CheckpointStore(url, "run", {"key": "k", "secret": "s"})
    assert list(tmp_path.iterdir()) == []  # no local directory named "s3:"


def test_permanent_errors_are_not_retried(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    storage = Storage(str(blocker), retry=RetryPolicy(attempts=50, base_s=10.0, max_s=20.0))
    t0 = time.monotonic()
    with pytest.raises(StorageError):
        storage.write_bytes("sub/x", b"1")  # parent is a file: NotADirectoryError/FileExistsError
    assert time.monotonic() - t0 < 4.0  # one retry would have slept at least 5 s (jitter: 0.5-1x)


def test_s3_leaves_integrity_to_the_manifest_unless_the_user_says_otherwise(moto_s3):
    # Every shard's sha256 is in the manifest and checked on every read, so botocore's own
    # checksums are off by default; a user's config_kwargs still win, and their other keys stay.
    url, options = backend_url("s3", "", moto_s3)
    storage = Storage(url, options, retry=FAST)
    storage.write_bytes("step-000000001/a.bin", b"x" * 100_000)
    assert storage.read_bytes("step-000000001/a.bin") == b"x" * 100_000
    fs, _ = storage._filesystem()
    assert fs.config_kwargs["request_checksum_calculation"] == "when_required"
    assert fs.config_kwargs["response_checksum_validation"] == "when_required"
    assert fs.config_kwargs["read_timeout"] == 5  # the options' own config_kwargs are kept
    assert "request_checksum_calculation" not in options["config_kwargs"]  # the user's dict is not changed

    mine = {**options, "config_kwargs": {"request_checksum_calculation": "when_supported", "read_timeout": 7}}
    storage = Storage(url, mine, retry=FAST)
    storage.write_bytes("step-000000001/b.bin", b"y" * 100_000)
    assert storage.read_bytes("step-000000001/b.bin") == b"y" * 100_000
    fs, _ = storage._filesystem()
    assert fs.config_kwargs == {"request_checksum_calculation": "when_supported", "read_timeout": 7,
                                "response_checksum_validation": "when_required"}


def test_s3_reads_a_small_or_unsized_file_with_one_get_and_a_large_one_in_ranges(moto_s3, monkeypatch):
    # s3fs asks for an object's size before reading it (a HEAD, and a LIST too when the key is
    # missing) to split a large one into concurrent ranged GETs. A manifest, or the missing one GC
    # asks about every step, needs one GET; a shard the manifest says is large keeps the ranges.
    url, options = backend_url("s3", "", moto_s3)
    storage = Storage(url, options, retry=FAST)
    storage.write_bytes("step-000000001/manifest.json", b"{}" * 100)
    storage.write_bytes("step-000000001/shard.bin", bytes(range(256)) * 1000)
    fs, _ = storage._filesystem()
    calls = []
    real = fs._call_s3

    async def spy(method, *args, **kwargs):
        calls.append(method)
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", spy)
    assert storage.read_bytes("step-000000001/manifest.json") == b"{}" * 100
    assert calls == ["get_object"]
    calls.clear()
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("step-000000002/manifest.json")
    assert calls == ["get_object"]
    calls.clear()
    assert storage.read_bytes("step-000000001/shard.bin", size=256_000) == bytes(range(256)) * 1000
    assert calls == ["get_object"]  # under one block
    calls.clear()
    monkeypatch.setattr(fs, "default_block_size", 100_000)
    assert storage.read_bytes("step-000000001/shard.bin", size=256_000) == bytes(range(256)) * 1000
    assert calls[0] == "head_object" and calls.count("get_object") == 3  # three ranges of a block
    calls.clear()
    # Larger than its record (replaced or appended to): one range, one byte past the record.
    assert storage.read_bytes("step-000000001/shard.bin", size=150_000) == (bytes(range(256)) * 1000)[:150_001]
    assert calls == ["head_object", "get_object"]


def refuse_in_bulk_deletes(fs, monkeypatch, refused: set[str], code: str = "InternalError") -> list[int]:
    """Make the S3 client's DeleteObjects answer as S3 does when it fails some keys: 200, those
    keys left in place and named under "Errors". Returns the number of keys of each request."""
    client = fs.s3
    real = client.delete_objects
    sizes = []

    async def delete_objects(**kwargs):
        objects = kwargs["Delete"]["Objects"]
        sizes.append(len(objects))
        kept = [o for o in objects if o["Key"] in refused]
        kwargs["Delete"] = {**kwargs["Delete"], "Objects": [o for o in objects if o not in kept]}
        out = await real(**kwargs) if kwargs["Delete"]["Objects"] else {}  # S3 refuses an empty list
        out["Errors"] = [{"Key": o["Key"], "Code": code, "Message": "We encountered an internal error."}
                         for o in kept]
        return out

    monkeypatch.setattr(client, "delete_objects", delete_objects)
    return sizes


def s3_storage_with(moto_s3, names: list[str]) -> tuple[Storage, object]:
    """An S3 Storage (moto) holding a one-byte file at each of ``names``, and its filesystem."""
    url, options = backend_url("s3", "", moto_s3)
    storage = Storage(url, options, retry=FAST)
    for name in names:
        storage.write_bytes(name, b"1")
    return storage, storage._filesystem()[0]


def test_s3_bulk_delete_raises_for_a_key_s3_did_not_delete(moto_s3, monkeypatch):
    storage, fs = s3_storage_with(moto_s3, ["d/a", "d/b", "d/c"])
    sizes = refuse_in_bulk_deletes(fs, monkeypatch, {"prefix/d/b"})
    with pytest.raises(StorageUnavailable, match=r"DeleteObjects left 1 of 3 keys: .*prefix/d/b: InternalError"):
        storage.delete_files(["d/a", "d/b", "d/c"], "d")
    assert sizes == [3] * FAST.attempts  # a transient error: retried
    assert storage.list_dir("d") == ["b"]
    sizes = refuse_in_bulk_deletes(fs, monkeypatch, {"prefix/d/b"}, code="AccessDenied")
    with pytest.raises(StorageError, match="AccessDenied") as info:
        storage.delete_files(["d/b"], "d")
    assert type(info.value) is StorageError and sizes == [1]  # PermissionError: not retried
    monkeypatch.undo()
    # Absent keys are deleted as far as S3 is concerned, and 1000 keys go in a request at most.
    sizes = refuse_in_bulk_deletes(fs, monkeypatch, set())
    assert storage.delete_files(["d/b"] + [f"d/absent-{i}" for i in range(1500)], "d")
    assert sizes == [1000, 501] and storage.list_dir("") == []


def test_s3_delete_tree_raises_for_a_key_s3_did_not_delete(moto_s3, monkeypatch):
    """The recursive delete (GC of an uncommitted step, a step whose files the caller does not
    know) checks DeleteObjects' answer key by key too: s3fs's own ``rm`` would drop the error."""
    storage, fs = s3_storage_with(moto_s3, ["t/a", "t/b", "t/sub/c"])
    sizes = refuse_in_bulk_deletes(fs, monkeypatch, {"prefix/t/sub/c"})
    with pytest.raises(StorageUnavailable, match=r"DeleteObjects left 1 of 1 keys: .*prefix/t/sub/c: InternalError"):
        storage.delete_tree("t")
    assert sizes == [3] + [1] * (FAST.attempts - 1)  # a transient error: retried, on what is left
    assert storage.list_dir("t") == ["sub"]
    monkeypatch.undo()
    storage.delete_tree("t")
    storage.delete_tree("t")  # gone: not an error
    assert storage.list_dir("") == []


def test_retention_keeps_a_step_whose_manifest_s3_did_not_delete(moto_s3, monkeypatch):
    """DeleteObjects answers 200 but leaves one of the manifests: that step must stay committed
    and whole (its files not deleted after it), be reported failed, and go on the next pass."""
    store = CheckpointStore(f"s3://{moto_s3.create_bucket()}", "run", moto_s3.storage_options(), retry=FAST)
    for step in (1, 2, 3):
        commit_tiny(store, step)
    files = {s: [f["path"] for f in store.load_manifest(s)["files"]] for s in (1, 2, 3)}
    fs, _ = store.storage._filesystem()
    refuse_in_bulk_deletes(fs, monkeypatch, {f"run/{step_dir(1)}/{MANIFEST}"})
    report = store.apply_retention(1, committed=[1, 2, 3], files=files)
    assert report.deleted == [] and sorted(report.failed) == [1, 2]
    assert "InternalError" in report.failed[1] and TEST_SECRET not in report.failed[1]
    assert store.committed_steps() == [1, 3]
    assert store.verify(1)  # committed and whole: its files are all there
    monkeypatch.undo()
    time.sleep(1.05)  # a failed delete is tried again after its backoff (1 s after a first failure)
    assert store.apply_retention(1, committed=[1, 3], files=files).deleted == [1, 2]
    assert store.step_dirs() == [3] and store.committed_steps() == [3]


def test_an_s3fs_without_concurrent_reads_gets_no_argument_it_does_not_know():
    class OldS3FileSystem:
        async def _cat_file(self, path, version_id=None, start=None, end=None):
            raise NotImplementedError

    class NewS3FileSystem:
        async def _cat_file(self, path, version_id=None, start=None, end=None, max_concurrency=None):
            raise NotImplementedError

    assert not _reads_concurrently(OldS3FileSystem)
    assert _reads_concurrently(NewS3FileSystem)


def test_two_runs_at_once_in_one_job_have_memory_hosts_of_their_own(ray_cluster, monkeypatch):
    # One job-wide host: the first run to finish killed it under the other (Tune trials as
    # actors of one job), whose writes then failed and whose checkpoints were lost.
    import uuid

    import ray

    from elastic.checkpoint import memory

    root = f"memory://two-runs-{uuid.uuid4().hex[:8]}"
    a, b = memory.DriverMirror(f"{root}/a"), memory.DriverMirror(f"{root}/b")
    assert a.name != b.name
    try:
        with a:
            with b:
                memory.ClusterMemoryFS(b.host).pipe_file(f"{root}/b/step-1/x", b"b's")
                memory.ClusterMemoryFS(a.host).pipe_file(f"{root}/a/step-1/x", b"a's")
            # b ended, a's host lives on and takes writes
            memory.ClusterMemoryFS(a.host).pipe_file(f"{root}/a/step-2/x", b"a's later")
            monkeypatch.setenv(memory.HOST_ENV, a.name)  # as in a's ranks (the controller's runtime_env)
            assert memory.host_name() == a.name
        local = a.local
        assert local.cat_file(f"{root}/a/step-2/x") == b"a's later" and local.cat_file(f"{root}/b/step-1/x") == b"b's"
        assert [n for n in ray.util.list_named_actors(all_namespaces=True) if n["namespace"] == memory.NAMESPACE] == []
    finally:
        clear_memory(root)


def test_a_runs_memory_host_gone_is_an_error_not_a_new_empty_host(ray_cluster, monkeypatch):
    # A rank found the run's host gone (killed, its node lost) and started an empty one of the
    # same name: the run's writes went there, and died with that rank; a replacement rank read
    # "step N is not committed" from it, with nothing to say the checkpoints were lost.
    import uuid

    import ray

    from elastic.checkpoint import memory
    from elastic.checkpoint.storage import StorageError

    name = f"memory-gone-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(memory.HOST_ENV, name)  # as in the run's ranks (the controller's runtime_env)
    host = memory._start_host(name)
    memory.ClusterMemoryFS(host).pipe_file("memory://gone/x", b"1")
    ray.kill(host, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the kill goes through the GCS
        try:
            ray.get_actor(name, namespace=memory.NAMESPACE)
        except ValueError:
            break
        time.sleep(0.1)
    with pytest.raises(StorageError, match=f"the run's memory:// host '{name}' is gone"):
        memory.cluster_filesystem()
    assert name not in [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]


def test_a_copy_back_that_fails_never_replaces_what_the_run_returns(ray_cluster, monkeypatch, caplog):
    # A file deleted between the host's listing and its read (a cleanup pass of a killed run)
    # raised FileNotFoundError out of the mirror's exit, replacing fit()'s result or error.
    import uuid

    from fsspec.implementations.memory import MemoryFileSystem

    from elastic.checkpoint import memory

    fs, root = MemoryFileSystem(), f"memory://gone-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(f"{root}/step-1/kept", b"1")

        class Racing:  # the listing names a file the read no longer finds
            def find(self, path):
                return fs.find(path) + [f"{root}/step-1/deleted"]

            def cat(self, paths, **kwargs):
                return fs.cat(paths, **kwargs)

        assert list(memory._tree(Racing(), root).values()) == [b"1"]  # the deleted one left out
        mirror = memory.DriverMirror(root)
        with caplog.at_level("WARNING"):
            with mirror:
                monkeypatch.setattr(memory, "_tree", lambda fs_, root_: (_ for _ in ()).throw(OSError("refused")))
        assert "could not be copied back from the run (OSError: refused)" in caplog.text
        assert fs.cat_file(f"{root}/step-1/kept") == b"1"  # the driver keeps what it had
    finally:
        clear_memory(root)


def test_a_local_file_is_replaced_whole_never_seen_half_written(tmp_path, monkeypatch):
    # Written in place, a reader opening the manifest between its truncation and its last byte
    # took a committed step for corrupt. Now a reader sees the old bytes or the new, never part.
    import os

    from elastic.checkpoint import storage as storage_module

    store = storage_module.Storage(f"file://{tmp_path}", {})
    store.write_bytes("step/manifest.json", b"old")
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append(open(dst, "rb").read())  # what a reader sees while the new bytes are written
        assert open(src, "rb").read() == b"new whole"
        return real_replace(src, dst)

    monkeypatch.setattr(storage_module.os, "replace", replace)
    store.write_bytes("step/manifest.json", [b"new ", b"whole"])
    assert seen == [b"old"] and store.read_bytes("step/manifest.json") == b"new whole"
    assert sorted(os.listdir(tmp_path / "step")) == ["manifest.json"]  # no temporary file left


def test_a_local_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    import os

    from elastic.checkpoint import storage as storage_module

    store = storage_module.Storage(f"file://{tmp_path}", {})

    def no_room(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage_module.os, "fsync", no_room)
    with pytest.raises(Exception):
        store.write_bytes("step/shard", b"data")
    assert os.listdir(tmp_path / "step") == []


@pytest.mark.parametrize("code", ["EINVAL", "ENAMETOOLONG", "ENOSPC", "EROFS", "EDQUOT"])
def test_an_oserror_retrying_cannot_fix_is_refused_at_once_not_retried_as_an_outage(tmp_path, code):
    # s3fs's InvalidArgument (EINVAL), a key too long, a full or read-only disk: retried as
    # transient, each cost ~1 s of sleeps and was reported as an outage.
    import errno

    store = Storage(f"file://{tmp_path}", {}, retry=RetryPolicy(attempts=4, base_s=5.0, max_s=5.0))
    calls = []

    def refuse():
        calls.append(1)
        raise OSError(getattr(errno, code), "refused (test)")

    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        store._call("write", "step/x", refuse)
    assert not isinstance(err.value, StorageUnavailable) and calls == [1] and time.monotonic() - t0 < 1
    transient = []

    def reset():
        transient.append(1)
        raise OSError(errno.ECONNRESET, "connection reset (test)")

    quick = Storage(f"file://{tmp_path}", {}, retry=RetryPolicy(attempts=3, base_s=0.01, max_s=0.01))
    with pytest.raises(StorageUnavailable):
        quick._call("read", "step/x", reset)
    assert transient == [1, 1, 1]


# ---- reads that must stop: a bound for files of unknown size, and local files that are no files ----
def test_a_read_with_max_size_takes_one_byte_past_it_and_refuses_a_larger_file(tmp_path, moto_s3, monkeypatch):
    """A manifest has no recorded size: ``max_size`` bounds it. On S3 still one GET (a range),
    and an empty object, which S3 refuses a range of, still reads."""
    for url, options in (backend_url("file", str(tmp_path)), backend_url("memory", str(tmp_path)),
                         backend_url("s3", "", moto_s3)):
        storage = Storage(url, options, retry=FAST)
        storage.write_bytes("step-000000001/manifest.json", b"m" * 100)
        storage.write_bytes("step-000000002/manifest.json", b"")
        calls, real = [], storage._call

        def call(op, rel, fn, retry=None):
            out = real(op, rel, fn, retry)
            calls.append(len(out))
            return out

        monkeypatch.setattr(storage, "_call", call)
        assert storage.read_bytes("step-000000001/manifest.json", max_size=100) == b"m" * 100
        assert storage.read_bytes("step-000000002/manifest.json", max_size=100) == b""
        with pytest.raises(FileRefused, match="manifest.json refused: larger than 99 bytes") as info:
            storage.read_bytes("step-000000001/manifest.json", max_size=99)
        assert info.value.reason == "larger than 99 bytes" and calls == [100, 0, 100], url  # 99 + 1
    url, options = backend_url("s3", "", moto_s3)
    storage = Storage(url, options, retry=FAST)
    storage.write_bytes("step-000000001/manifest.json", b"m" * 100)
    fs, _ = storage._filesystem()
    methods, real_s3 = [], fs._call_s3

    async def spy(method, *args, **kwargs):
        methods.append((method, kwargs.get("Range")))
        return await real_s3(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", spy)
    with pytest.raises(FileRefused):
        storage.read_bytes("step-000000001/manifest.json", max_size=10)
    assert methods == [("get_object", "bytes=0-10")]


def _within(fn, timeout_s: float = 20.0):
    """``fn()``'s outcome (its result or its exception), failing if it blocks past ``timeout_s``."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(done=_outcome(fn)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still blocked after {timeout_s} s"
    return out["done"]


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed back to the test
        return exc


def test_a_local_read_refuses_a_fifo_a_device_or_a_directory_at_once(tmp_path):
    """A FIFO blocked open() for good; a link to /dev/zero read without end (the read of a
    bounded size stopped, but an unbounded one did not); a directory failed as IsADirectoryError.
    Each is refused without a byte read, and not retried (FileRefused is permanent)."""
    storage = Storage(f"file://{tmp_path}", retry=RetryPolicy(attempts=50, base_s=10.0, max_s=20.0))
    os.mkdir(tmp_path / "d")
    os.mkfifo(tmp_path / "d" / "fifo")
    os.symlink("/dev/zero", tmp_path / "d" / "zero")
    os.mkdir(tmp_path / "d" / "dir")
    try:
        for name in ("fifo", "zero", "dir"):
            for kwargs in ({"size": 10}, {"max_size": 10}):
                exc = _within(lambda: storage.read_bytes(f"d/{name}", **kwargs))
                assert isinstance(exc, FileRefused), (name, exc)
                assert "not a regular file" in exc.reason and f"read file://{tmp_path}/d/{name} refused" in str(exc)
    finally:
        with contextlib.suppress(OSError):  # a reader blocked in open() (the old code) gets EOF
            os.close(os.open(tmp_path / "d" / "fifo", os.O_WRONLY | os.O_NONBLOCK))
    # A regular file, with a record far larger than memory: no more than the file is asked for.
    storage.write_bytes("d/f", b"x" * 1000)
    assert storage.read_bytes("d/f", size=2 ** 40) == b"x" * 1000
    assert storage.read_bytes("d/f", size=10) == b"x" * 11


@pytest.mark.parametrize("error", [MemoryError, OverflowError])
def test_an_error_of_memory_or_range_is_no_outage(tmp_path, error):
    """Retried as transient, a MemoryError was reported as a storage outage, and a resume
    waited resume_timeout_s for storage that was up."""
    storage = Storage(f"file://{tmp_path}", retry=RetryPolicy(attempts=5, base_s=10.0, max_s=20.0))
    calls = []

    def fail():
        calls.append(1)
        raise error("too large")

    with pytest.raises(StorageError) as info:
        storage._call("read", "x", fail)
    assert not isinstance(info.value, StorageUnavailable) and calls == [1]


def test_local_links_below_the_root_are_refused_for_writes_and_deletes_and_skipped_by_a_listing(tmp_path):
    """The root may be a link (a user's ``ckpt -> /mnt/big``); nothing below it is followed for a
    write or a delete, and a listing can leave links out (``CheckpointStore.step_dirs``)."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "root")
    storage = Storage(f"file://{tmp_path}/root", retry=FAST)
    storage.write_bytes("step-000000001/a", b"1")  # through the root's link: fine
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "a").write_bytes(b"theirs")
    os.symlink(tmp_path / "theirs", tmp_path / "real" / "step-000000002")
    assert storage.list_dir("") == ["step-000000001", "step-000000002"]
    assert storage.list_dir("", skip_links=True) == ["step-000000001"]
    for call in (lambda: storage.write_bytes("step-000000002/a", b"ours"),
                 lambda: storage.delete("step-000000002/a"),
                 lambda: storage.delete_files(["step-000000002/a"], "step-000000002"),
                 lambda: storage.delete_tree("step-000000002")):
        with pytest.raises(StorageError, match="step-000000002 is a symbolic link"):
            call()
    assert (tmp_path / "theirs" / "a").read_bytes() == b"theirs"
    assert os.path.islink(tmp_path / "real" / "step-000000002")
    storage.delete_tree("step-000000001")
    assert storage.list_dir("") == ["step-000000002"]
