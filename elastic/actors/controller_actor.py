"""The controller hosted in a named Ray actor, so ``elastic status`` and the dashboard can find it.

``run`` drives training in the actor's default thread; ``status`` answers from a second thread
while a run is in progress, and ``checkpoint_written`` (ranks reporting written checkpoint parts)
from a third.
"""

from __future__ import annotations

import logging
import traceback

import ray

from elastic.checkpoint.compat import UnsaveableState
from elastic.config import ConfigError, env_log_level
from elastic.controller import Controller
from elastic.redact import configure_logging

logger = logging.getLogger(__name__)


def _log_level() -> str:
    """ELASTIC_LOG_LEVEL as this process has it. The driver refused a bad one before the run
    started (``check_environment``); one set for the actors alone (a runtime_env) is not worth
    the run: WARNING, said once."""
    try:
        return env_log_level()
    except ConfigError as exc:
        logger.warning("%s Logging at WARNING.", exc)
        return "WARNING"


class ControllerActor:
    def __init__(self, kwargs: dict):
        from elastic.checkpoint import memory

        memory.join_run()  # memory:// here is the run's shared copy (elastic/checkpoint/memory.py)
        configure_logging(_log_level())
        self.controller = Controller(**kwargs)
        self._error: str | None = None

    def run(self, total_steps: int | None, epochs: int | None) -> dict:
        c = self.controller
        try:
            c.run_for(total_steps, epochs)
            return c.result(include_state=True)
        except BaseException as exc:
            self._error = c.redact("".join(traceback.format_exception(exc)))
            out = c.result(include_state=False)
            out["error"] = error = {"type": type(exc).__name__, "message": c.redact(str(exc)),
                                    "traceback": self._error}
            if isinstance(exc, UnsaveableState):  # raised at the driver as this class (trainer._raise_run_error)
                error["args"] = [c.redact(exc.problem), exc.step]
            return out
        finally:
            c.shutdown()

    @ray.method(concurrency_group="status")
    def status(self) -> dict:
        return self.controller.status()

    @ray.method(concurrency_group="status")
    def stop(self, reason: str) -> None:
        """End the run after the steps already dispatched, with their checkpoint committed."""
        self.controller.request_stop(reason)

    @ray.method(concurrency_group="wait")
    def wait_ended(self, timeout_s: float) -> dict | None:
        """Blocks a thread of its own (not the status thread) until the run has ended."""
        return self.controller.wait_ended(timeout_s)

    @ray.method(concurrency_group="checkpoint")
    def checkpoint_written(self, step: int, world_size: int, parts: dict) -> None:
        """Ranks wrote their parts of ``step`` (sent from a writer thread, not with step results)."""
        self.controller.checkpoint_written(step, world_size, parts)

    @ray.method(concurrency_group="checkpoint")
    def checkpoint_events(self, events: list) -> None:
        """Storage events of the nodes' checkpoint agents, ``[(rank, event), ...]``."""
        self.controller.checkpoint_events(events)
