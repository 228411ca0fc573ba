"""Named actors whose earlier holder was just killed: ``ray.kill`` returns before the GCS frees the name."""

from __future__ import annotations

import time


def free_actor_name(name: str, namespace: str | None, timeout_s: float = 10.0) -> None:
    """Kill the actor holding ``name`` and wait until the name is free (``ray.kill`` returns first).

    For a name that belongs to this run: an actor of an earlier group of its ranks or spares (a
    restart killed them and starts new ones of the same names at once), or an earlier run's node
    agent whose controller is gone. Ray checks a name when the actor is created (``.remote()``
    raises ``ActorAlreadyExistsError``, a ValueError) and frees it once the GCS marks the killed
    actor dead, which may come after the new group's placement is ready."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            return
        time.sleep(0.05)
