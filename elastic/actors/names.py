"""Named actors whose earlier holder was just killed: ``ray.kill`` returns before the GCS frees the name."""

from __future__ import annotations

import time


def free_actor_name(name: str, namespace: str | None, timeout_s: float = 10.0, actor_id: str | None = None) -> None:
    """Kill the actor holding ``name`` and wait until the name is free (``ray.kill`` returns first).

    For a name that belongs to this run: an actor of an earlier group of its ranks or spares (a
    restart killed them and starts new ones of the same names at once), or an earlier run's node
    agent whose controller is gone. Ray checks a name when the actor is created (``.remote()``
    raises ``ActorAlreadyExistsError``, a ValueError) and frees it once the GCS marks the killed
    actor dead, which may come after the new group's placement is ready.

    Only one actor is killed: ``actor_id`` (hex), the holder the caller checked, or else the one
    holding the name at the first look. Why: between two looks the name can be freed and taken
    by another actor (another driver's run of the same name), which a kill of whoever holds
    the name would end. Then this returns, and the caller's create fails on the name."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            holder = ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        held_by = holder._actor_id.hex()
        if actor_id is None:
            actor_id = held_by
        elif held_by != actor_id:
            return
        ray.kill(holder, no_restart=True)
        time.sleep(0.05)
