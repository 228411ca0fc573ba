"""The Makefile's setup (``make setup``, which ``make demo`` and ``make test`` start with), run on a
copy of it in a temporary directory with stand-in Pythons that log what they are asked: no venv,
no pip, no network. A setup's inputs (PY, TORCH, TORCH_INDEX_URL) count on an existing .venv too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make here")

# A stand-in interpreter of one version. `-m venv DIR` copies it to DIR/bin/python; a pip install
# of torch remembers the version it pinned, which `import torch` in a `-c` program then reports
# (one from https://unreachable.invalid fails);
# any other `-c` program really runs (so the setup's checks raise or pass as they would).
FAKE_PYTHON = '''#!{real}
import os, shlex, shutil, sys, types
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(shlex.join([os.path.basename(sys.argv[0]), *args]) + "\\n")
torch_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch-version")
if args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[2], "bin"))
    shutil.copy(__file__, os.path.join(args[2], "bin", "python"))
elif args[:3] == ["-m", "pip", "install"] and "https://unreachable.invalid" in args:
    sys.exit("no such index")
elif args[:4] == ["-m", "pip", "install", "--quiet"] and args[4].startswith("torch"):
    with open(torch_file, "w") as f:
        f.write(args[4].split("==", 1)[-1])
elif args[:1] == ["-c"] and '"%d.%d"' in args[1]:
    print("{version}")
elif args[:1] == ["-c"]:
    torch = sys.modules["torch"] = types.ModuleType("torch")
    torch.__version__ = open(torch_file).read() if os.path.exists(torch_file) else "2.13.0"
    sys.argv = ["-c"]
    exec(args[1], {{"__name__": "__main__"}})
'''


@pytest.fixture
def project(tmp_path):
    """A directory with the Makefile and pyproject.toml, a PATH with stand-ins for python3.11,
    python3.12 and python3 (3.11) and the few tools the recipes use, and ``run(*args)``."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name, version in (("python3.11", "3.11"), ("python3.12", "3.12"), ("python3", "3.11")):
        add_python(bin_dir, name, version)
    for tool in ("cat", "touch", "rm"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    log = tmp_path / "calls.log"
    # Nothing from the caller's make (`make test` exports MAKEFLAGS with its own TORCH=...) or shell.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PY", "TORCH", "TORCH_INDEX_URL", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    env.update(PATH=str(bin_dir), FAKE_LOG=str(log))

    def run(*args: str) -> subprocess.CompletedProcess:
        log.write_text("")
        return subprocess.run([MAKE, "--no-print-directory", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    run.dir, run.bin, run.log = tmp_path, bin_dir, log
    return run


def add_python(bin_dir, name: str, version: str) -> None:
    path = bin_dir / name
    path.write_text(FAKE_PYTHON.format(real=sys.executable, version=version))
    path.chmod(0o755)


def calls(project) -> list[str]:
    return project.log.read_text().splitlines()


def installs(project) -> list[str]:
    return [c for c in calls(project) if c.startswith("python -m pip ")]


def set_up(project, *args: str) -> None:
    done = project("setup", *args)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_second_setup_with_nothing_named_installs_nothing(project):
    set_up(project)
    assert installs(project)[1:] == ["python -m pip install --quiet torch==2.13.0",
                                     "python -m pip install --quiet -e '.[test,bench]' torch==2.13.0"]
    assert (project.dir / ".venv" / ".setup-inputs").read_text() == "TORCH=torch==2.13.0\nTORCH_INDEX_URL=\n"
    again = project("setup")
    assert again.returncode == 0 and calls(project) == [] and "Nothing to be done" in again.stdout
    assert "pip" not in project("-n", "setup").stdout


def test_a_named_torch_installs_into_the_existing_venv(project):
    # Before, .venv/.installed depended on pyproject.toml alone: TORCH=torch==2.11.0 on a venv set
    # up with 2.13.0 installed nothing and ran on 2.13.0 without a word.
    set_up(project)
    assert 'pip install --quiet "torch==2.11.0"' in project("-n", "setup", "TORCH=torch==2.11.0").stdout
    set_up(project, "TORCH=torch==2.11.0")
    assert "python -m pip install --quiet torch==2.11.0" in installs(project)
    assert not any(c.startswith("python3") for c in calls(project))  # the same venv, not a new one
    set_up(project, "TORCH=torch==2.11.0")
    assert calls(project) == []
    # TORCH is this run's: one that names none is back on the Makefile's pin.
    set_up(project)
    assert "python -m pip install --quiet torch==2.13.0" in installs(project)


def test_a_named_index_replaces_the_venvs_torch_and_stays(project):
    # Before: `make demo TORCH_INDEX_URL=.../cpu`, as the README has it for the CPU build, on a
    # venv already set up installed nothing; and pip alone keeps an installed torch that meets
    # the pin, whichever build it is, so the torch must go before the install from the new index.
    set_up(project)
    cpu = "https://download.pytorch.org/whl/cpu"
    set_up(project, f"TORCH_INDEX_URL={cpu}")
    assert installs(project)[1:3] == ["python -m pip uninstall --quiet --quiet --yes torch",
                                      f"python -m pip install --quiet torch==2.13.0 --index-url {cpu}"]
    # A later run that names no index keeps the venv's: a plain `make test` must not bring back
    # the default index's build (on PyPI, the multi-GB CUDA one).
    set_up(project)
    assert calls(project) == []
    set_up(project, "TORCH=torch==2.11.0")
    assert f"python -m pip install --quiet torch==2.11.0 --index-url {cpu}" in installs(project)
    # An empty one names pip's own index again.
    set_up(project, "TORCH_INDEX_URL=")
    assert installs(project)[1:3] == ["python -m pip uninstall --quiet --quiet --yes torch",
                                      "python -m pip install --quiet torch==2.13.0"]


def test_an_install_that_stops_halfway_is_done_again(project):
    # The old torch is gone once a new index's install starts: were the stamp left in place, a run
    # back on the old index would have found the inputs as recorded and run without torch.
    set_up(project)
    assert project("setup", "TORCH_INDEX_URL=https://unreachable.invalid").returncode != 0
    assert "python -m pip uninstall --quiet --quiet --yes torch" in installs(project)
    set_up(project)
    assert "python -m pip install --quiet torch==2.13.0" in installs(project)


def test_a_venv_from_before_the_record_installs_only_when_something_is_named(project):
    set_up(project)
    (project.dir / ".venv" / ".setup-inputs").unlink()
    set_up(project)
    assert calls(project) == []
    set_up(project, "TORCH=torch==2.11.0")
    assert "python -m pip install --quiet torch==2.11.0" in installs(project)


def test_a_named_python_of_another_version_asks_for_a_new_venv(project):
    # Before, PY=python3.12 on a venv made by python3.11 did nothing and ran on 3.11.
    set_up(project)
    refused = project("setup", "PY=python3.12")
    assert refused.returncode != 0
    assert ".venv has Python 3.11, not PY=python3.12 (3.12)" in refused.stderr
    assert "remove .venv (make clean) and run make again" in refused.stderr
    assert installs(project) == []
    # The same Python by another name is the same venv.
    set_up(project, "PY=python3")
    assert installs(project) == []
    # What the message says to do works.
    assert project("clean", "PY=python3.12").returncode == 0
    set_up(project, "PY=python3.12")
    assert calls(project)[0] == "python3.12 -m venv .venv"


def test_python3_stands_in_only_for_the_default(project):
    # Before, a named PY missing here fell back to python3: another Python than the one asked for.
    (project.bin / "python3.11").unlink()
    missing = project("setup", "PY=python3.99")
    assert missing.returncode != 0 and "python3.99" in missing.stderr
    assert calls(project) == [] and not (project.dir / ".venv").exists()
    set_up(project)  # the default python3.11 is missing: python3 makes the venv, as before
    assert calls(project)[0] == "python3 -m venv .venv"


@pytest.mark.parametrize("torch", ["torch>=2.5,<2.15", "torch", "torch==2.13.*", "2.13.0"])
def test_a_torch_that_is_not_one_version_is_refused_before_any_install(project, torch):
    # Before, the check after the install raised IndexError on TORCH='torch>=2.5,<2.15', with a
    # traceback and the whole install already done.
    refused = project("setup", f"TORCH={torch}")
    assert refused.returncode != 0
    assert f"TORCH={torch}: name one version, as TORCH=torch==2.13.0" in refused.stderr
    assert "Traceback" not in refused.stderr and calls(project) == []


def test_a_pin_with_a_local_version_passes_the_check(project):
    set_up(project, "TORCH=torch==2.13.0+cpu")
    assert "python -m pip install --quiet torch==2.13.0+cpu" in installs(project)
