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


def _remove_leftover_placement(c: Controller) -> None:
    """Remove the placement groups an earlier controller of this run left, before this one
    places its own: their CPUs and GPUs are reserved for nothing.

    Why they can be there: Ray frees a group when its creator actor and its creator's job are
    both dead, so the groups of a controller that was killed (a second interrupt, the stop
    timeout, the controller lost) stay while its driver lives. The driver removes them right
    after the kill (``Trainer._release_placement``), but that sweep can miss a group: a group
    the dying controller asked for after the sweep read the table (``ray.kill`` returns before
    the process is gone), a sweep cut short by a third interrupt, or a GCS call that failed. A
    next fit() of the run then waited ``placement_timeout_s`` for resources its own dead run held,
    and failed saying the cluster had no room.

    Why it cannot remove a live run's: this actor holds the name "controller" in the run's
    namespace (Ray keeps actor names unique, and ``Trainer._claim_run_name`` refuses a live
    holder), and only the actor holding that name creates groups named ``elastic-<run>/...``.
    So every group of that prefix now is a dead controller's."""
    from elastic.actors.worker_group import remove_run_placement_groups

    try:
        removed = remove_run_placement_groups(f"elastic-{c.run_config.name}")
    except Exception:  # noqa: BLE001 - the run can still place where there is room
        logger.warning("could not look for placement groups an earlier controller of run %r left",
                       c.run_config.name, exc_info=True)
        return
    if removed:
        c.log("placement", f"removed the placement groups an earlier controller of this run left: "
              f"{', '.join(removed)}", removed=removed)


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
            _remove_leftover_placement(c)
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

    @ray.method(concurrency_group="stop")
    def stop(self, reason: str) -> None:
        """End the run after the steps already dispatched, with their checkpoint committed. A
        thread of its own: a status() call in progress does not hold a stop back."""
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
