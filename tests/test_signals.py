"""fit()'s SIGTERM handling (what ``ray job stop`` sends), without Ray: who gets the signal when."""

from __future__ import annotations

import os
import signal

import pytest

from elastic.trainer import _sigterm_stops_the_run


@pytest.fixture
def default_sigterm():
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_while_waiting_is_a_marked_interrupt_and_the_second_one_is_the_old_handlers(default_sigterm):
    with _sigterm_stops_the_run() as signals:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # a point where the handler runs, as it does inside ray.get
        assert signals == {"SIGTERM"}
        # The first SIGTERM handed the signal back: a second would end the process as before.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_previous_handler_is_back_after_fit(default_sigterm):
    with _sigterm_stops_the_run() as signals:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signals == set() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_of_the_users_stays_in_charge(default_sigterm):
    got = []

    def mine(signum, frame):
        got.append(signum)

    signal.signal(signal.SIGTERM, mine)
    with _sigterm_stops_the_run() as signals:
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)
    assert got == [signal.SIGTERM] and signals == set()


def test_a_handler_installed_from_c_stays_in_charge(default_sigterm, monkeypatch):
    # Python reads a handler installed from C as None, which signal.signal does not take back:
    # taken over, the first SIGTERM raised a TypeError where it should have stopped the run.
    from elastic import trainer as trainer_module

    swapped = []
    monkeypatch.setattr(trainer_module.signal, "getsignal", lambda signum: None)
    monkeypatch.setattr(trainer_module.signal, "signal", lambda signum, handler: swapped.append(handler))
    with _sigterm_stops_the_run() as signals:
        pass
    with trainer_module._users_sigterm_kept():
        pass
    assert swapped == [] and signals == set()


def test_a_ctrl_c_as_the_embedded_ray_comes_up_shuts_it_down(monkeypatch):
    # A Ctrl-C after ray.init returned and before the fit counted the Ray as its own left it up,
    # uncounted: the next fit() took it for the user's and never shut it down.
    from elastic import trainer as trainer_module

    shut = []

    def connect(address, min_cpus, use_gpu):
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as ray.init returns
        return True

    monkeypatch.setattr(trainer_module, "connect", connect)
    monkeypatch.setattr(trainer_module.ray, "shutdown", lambda: shut.append(True))
    with pytest.raises(KeyboardInterrupt):
        with trainer_module._ray_for_fit(None, 1, False):
            pytest.fail("trained on after the Ctrl-C")
    assert shut == [True] and trainer_module._embedded_fits == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_connects_error_is_told_and_the_interrupt_handler_is_back(monkeypatch):
    from elastic import trainer as trainer_module
    from elastic.config import ConfigError

    def connect(address, min_cpus, use_gpu):
        raise ConfigError("Trainer.address='x:1': nothing answers there")

    monkeypatch.setattr(trainer_module, "connect", connect)
    with pytest.raises(ConfigError, match="nothing answers"):
        with trainer_module._ray_for_fit("x:1", 1, False):
            pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and trainer_module._embedded_fits == 0


USERS_HANDLER_THROUGH_CONNECT = """
import signal, sys
import ray
from elastic.trainer import _sigterm_stops_the_run, connect

def mine(signum, frame):
    print("mine", flush=True)

signal.signal(signal.SIGTERM, mine)
assert connect(None, min_cpus=1) is True  # an embedded Ray: ray.init installs a SIGTERM handler of its own
try:
    assert signal.getsignal(signal.SIGTERM) is mine, signal.getsignal(signal.SIGTERM)
    with _sigterm_stops_the_run() as signals:  # as fit() waits
        assert signal.getsignal(signal.SIGTERM) is mine
    assert signal.getsignal(signal.SIGTERM) is mine
finally:
    ray.shutdown()
print("ok", flush=True)
"""


@pytest.mark.slow
def test_a_users_handler_stays_in_charge_through_the_ray_init_of_connect():
    """README: "A SIGTERM handler of your own stays in charge." ray.init installs Ray's own
    handler, which fit() used to take for the default: it took SIGTERM over and put Ray's back."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # connect(None) then starts its own Ray
    out = subprocess.run([sys.executable, "-c", USERS_HANDLER_THROUGH_CONNECT], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.parametrize("address, ray_address, embedded, init_address", [
    ("local", "", True, "local"),
    ("local", "10.0.0.1:6379", True, "local"),  # "local" is a new local Ray whatever RAY_ADDRESS says
    (None, "", True, "local"),
    (None, "10.0.0.1:6379", False, "auto"),
    ("10.0.0.1:6379", "", False, "10.0.0.1:6379"),
])
def test_which_addresses_start_the_embedded_ray_that_fit_shuts_down(monkeypatch, address, ray_address, embedded,
                                                                    init_address):
    # address="local" went to ray.init as it was: a local Ray that fit() never shut down, without
    # the driver's import path for the workers.
    import ray

    from elastic import trainer as trainer_module

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RAY_ADDRESS", ray_address)
    assert trainer_module.connect(address, min_cpus=1) is embedded
    assert [c["address"] for c in calls] == [init_address]
    if embedded:
        assert "PYTHONPATH" in calls[0]["runtime_env"]["env_vars"]
