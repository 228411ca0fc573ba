"""deploy/: every YAML parses, every job entrypoint names a script of this repository with flags it
accepts, auth stays on, and the Dockerfile builds what the manifests run. No Kubernetes needed.
"""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
YAMLS = sorted(glob.glob(os.path.join(DEPLOY, "**", "*.y*ml"), recursive=True))


def documents(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def entrypoints(doc: dict) -> list[str]:
    """RayJob ``spec.entrypoint``; any other ``entrypoint`` key found in the document, too."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "entrypoint" and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return found


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_deploy_has_the_expected_files():
    names = {os.path.relpath(p, DEPLOY) for p in glob.glob(os.path.join(DEPLOY, "*"))}
    assert {"rayjob-digits.yaml", "raycluster-gpu.yaml", "Dockerfile", "README.md"} <= names


@pytest.mark.parametrize("path", YAMLS, ids=[os.path.relpath(p, ROOT) for p in YAMLS])
def test_yaml_parses_into_kubernetes_objects(path):
    docs = documents(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), doc


WITH_ENTRYPOINTS = [p for p in YAMLS if any(entrypoints(doc) for doc in documents(p))]


def test_every_rayjob_has_an_entrypoint():
    # The check below runs over the files that have one: a RayJob must (a RayCluster has none).
    jobs = [(p, doc) for p in YAMLS for doc in documents(p) if doc.get("kind") == "RayJob"]
    assert jobs and all(entrypoints(doc) for _, doc in jobs)
    assert {p for p, _ in jobs} <= set(WITH_ENTRYPOINTS)


@pytest.mark.parametrize("path", WITH_ENTRYPOINTS, ids=[os.path.relpath(p, ROOT) for p in WITH_ENTRYPOINTS])
def test_entrypoints_name_scripts_in_the_repo(path):
    for doc in documents(path):
        for entrypoint in entrypoints(doc):
            args = shlex.split(entrypoint)
            scripts = [a for a in args if a.endswith(".py")]
            assert args[0].startswith("python") and scripts, entrypoint
            script = os.path.join(ROOT, scripts[0])
            assert os.path.isfile(script), f"{entrypoint!r} names {scripts[0]}, which is not in the repository"
            # Every --flag must be one the script's argparse declares.
            source = open(script).read()
            declared = set(re.findall(r"add_argument\(\s*[\"'](--[\w-]+)", source))
            used = {a.split("=", 1)[0] for a in args[args.index(scripts[0]) + 1:] if a.startswith("--")}
            assert used <= declared, f"{entrypoint!r}: {sorted(used - declared)} not accepted by {scripts[0]}"


def test_rayjob_runs_digits_with_workers_and_spares():
    (job,) = documents(os.path.join(DEPLOY, "rayjob-digits.yaml"))
    assert job["kind"] == "RayJob"
    args = shlex.split(job["spec"]["entrypoint"])
    assert args[:2] == ["python", "examples/digits.py"]
    flags = dict(zip(args[2::1], args[3::1]))
    assert int(flags["--workers"]) >= 2 and int(flags["--spares"]) >= 1
    assert "--storage" in flags


def test_manifests_give_ray_job_stop_time_for_a_clean_stop():
    """`ray job stop` kills the driver RAY_JOB_STOP_WAIT_TIME_S after SIGTERM (3 s by Ray's
    default): above RunConfig.stop_timeout_s (60 s), so the clean stop can finish."""
    (job,) = documents(os.path.join(DEPLOY, "rayjob-digits.yaml"))
    env_vars = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert int(env_vars["RAY_JOB_STOP_WAIT_TIME_S"]) > 60
    (cluster,) = documents(os.path.join(DEPLOY, "raycluster-gpu.yaml"))
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert int({e["name"]: e.get("value") for e in head["env"]}["RAY_JOB_STOP_WAIT_TIME_S"]) > 60
    with open(os.path.join(DEPLOY, "README.md")) as f:
        assert "RAY_JOB_STOP_WAIT_TIME_S=70" in f.read()


@pytest.mark.parametrize("name", ["rayjob-digits.yaml", "raycluster-gpu.yaml"])
def test_every_ray_pod_gives_the_object_store_a_memory_backed_dev_shm(name):
    # A container's /dev/shm is 64 MiB by default; Ray's object store then goes to disk.
    (doc,) = documents(os.path.join(DEPLOY, name))
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    for group in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            (mount,) = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory", (name, c["name"])
            limit = volumes[mount["name"]]["emptyDir"]["sizeLimit"]
            assert limit.endswith("Gi") and int(limit[:-2]) < int(c["resources"]["limits"]["memory"][:-2])


@pytest.mark.parametrize("name", ["rayjob-digits.yaml", "raycluster-gpu.yaml"])
def test_manifests_keep_token_auth_on(name):
    (doc,) = documents(os.path.join(DEPLOY, name))
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    assert spec.get("authOptions", {}).get("mode") == "token"
    for c in containers(doc):
        for env in c.get("env", []):
            assert not (env["name"] == "RAY_AUTH_MODE" and env.get("value") == "disabled")


def test_raycluster_has_a_gpu_worker_group():
    (cluster,) = documents(os.path.join(DEPLOY, "raycluster-gpu.yaml"))
    assert cluster["kind"] == "RayCluster"
    gpu_groups = [g for g in cluster["spec"]["workerGroupSpecs"]
                  if any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                         for c in g["template"]["spec"]["containers"])]
    assert gpu_groups


def test_manifests_use_the_image_the_dockerfile_builds():
    images = {c["image"] for name in ("rayjob-digits.yaml", "raycluster-gpu.yaml")
              for c in containers(documents(os.path.join(DEPLOY, name))[0])}
    assert len(images) == 1, images
    dockerfile = open(os.path.join(DEPLOY, "Dockerfile")).read()
    assert re.search(r"^FROM python:3\.11", dockerfile, re.M)
    assert "TORCH_VERSION=2.13.0" in dockerfile and "torch==${TORCH_VERSION}" in dockerfile
    # The package with the extra examples/digits.py needs, after torch and with torch pinned again
    # (pip's resolver may otherwise swap the installed torch for the newest build).
    (package_install,) = [line for line in dockerfile.splitlines() if re.search(r'pip install "?\.', line)]
    assert '".[examples]"' in package_install and '"torch==${TORCH_VERSION}"' in package_install
    assert dockerfile.index("torch==") < dockerfile.index(package_install)
    # The image's Ray is the one the manifests name (KubeRay runs the cluster as that version).
    versions = {doc["spec"].get("rayVersion") or doc["spec"]["rayClusterSpec"]["rayVersion"]
                for name in ("rayjob-digits.yaml", "raycluster-gpu.yaml")
                for doc in documents(os.path.join(DEPLOY, name))[:1]}
    assert len(versions) == 1 and f"RAY_VERSION={versions.pop()}" in dockerfile
    assert '"ray[default]==${RAY_VERSION}"' in dockerfile


def test_dockerfile_extras_exist_and_core_needs_no_ray_train():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    dockerfile = open(os.path.join(DEPLOY, "Dockerfile")).read()
    for extras in re.findall(r'pip install "\.\[([\w,]+)\]"', dockerfile):
        assert set(extras.split(",")) <= set(project["optional-dependencies"]), extras
    # Only benchmarks/ use Ray Train: the core dependency is ray[default], the bench extra adds train.
    assert not [d for d in project["dependencies"] if re.match(r"ray\[[^\]]*train", d)]
    assert any(re.match(r"ray\[train\]", d) for d in project["optional-dependencies"]["bench"])


def declared_metrics() -> set[str]:
    """Prometheus names of the metrics elastic/metrics.py declares (Ray adds the ``ray_`` prefix)."""
    source = open(os.path.join(ROOT, "elastic", "metrics.py")).read()
    return {f"ray_{name}" for name in re.findall(r"(?:Histogram|Gauge|Counter)\(\s*\"(elastic_\w+)\"", source)}


def test_grafana_dashboard_queries_only_declared_metrics_and_all_of_them():
    import json

    with open(os.path.join(DEPLOY, "grafana-elastic.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"ray_elastic_\w+", e)}
    declared = declared_metrics()
    assert declared, "no metrics found in elastic/metrics.py"
    assert used <= declared, f"panels query undeclared metrics: {sorted(used - declared)}"
    assert declared <= used, f"metrics without a panel: {sorted(declared - used)}"


def test_grafana_counter_panels_count_a_series_first_increments():
    # A Ray counter's series first appears at its first value (Counter.inc refuses 0, so it
    # cannot start at 0), and PromQL's increase() and rate() see no rise before a series' first
    # sample: a run's only failure, its only recovery, the first burst of fp16 skips never
    # showed, and every resume (a new controller process, a new series) lost its first again.
    # Each counter panel takes a series new within its window whole.
    import json

    with open(os.path.join(DEPLOY, "grafana-elastic.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"] if "_total" in t["expr"]]
    assert len(exprs) == 4, exprs
    for expr in exprs:
        counter = re.search(r"ray_elastic_\w+_total", expr).group(0)
        selector = counter + '{run=~"$run"}'
        assert f"({selector} unless {selector} offset 5m) or increase({selector}[5m])" in expr, expr
        assert "rate(" not in expr, expr
