"""A Ray cluster address, checked before ``ray.init`` gets it.

``ray.init`` given a malformed address raises a bare ``ValueError``, and given one where nothing
listens it retries for a minute while Ray's C++ core logs each try; both the Trainer and the CLI
check first and say which setting to change.
"""

from __future__ import annotations

import socket

PROBE_TIMEOUT_S = 5.0
NAMED_ADDRESSES = ("auto", "local")  # Ray's own names: the recorded cluster (or RAY_ADDRESS), a new local one


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``HOST:PORT``, ``ray://HOST:PORT`` or ``[IPv6]:PORT``; None when it is neither.
    A host with a colon outside brackets is none: a bare IPv6 address (``::1``, whose last group
    read as a port) or a scheme mistyped (``ray:/head:6379``), which went on to "nothing answers
    there" instead of "not a Ray address"."""
    hostport = address.split("://", 1)[-1].rstrip("/").rpartition("@")[2]  # a user:password@ is no host's
    host, _, port = hostport.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif any(c in host for c in ":[]/"):
        return None
    return host, int(port)


def shown(address: str) -> str:
    """``address`` as messages show it: a ``user:password@`` (no Ray address has one, but a user
    may paste one, with or without a scheme) as ``***@``, and no query string (a token there)."""
    head, at, tail = address.rpartition("@")
    if at:
        scheme = head.split("://", 1)[0] + "://" if "://" in head else ""
        address = f"{scheme}***@{tail}"
    return address.split("?", 1)[0]


def trainer_address_problem(address: str) -> str | None:
    """Why ``address`` cannot be the Trainer's (what ``ray.init`` joins), or None. A Ray address is
    ``HOST:PORT`` of the GCS, ``ray://HOST:PORT`` of a Ray Client server, or a name Ray knows.
    An ``http://`` address is the dashboard's, which Ray Jobs (``elastic submit``) takes and
    ``ray.init`` refuses with an error about RAY_ADDRESS; a ``user:password@`` belongs to no Ray
    address and would be echoed by Ray's messages."""
    if address in NAMED_ADDRESSES:
        return None
    if "@" in address:
        return "holds a user:password@, which no Ray address has (Ray's token auth reads RAY_AUTH_TOKEN)"
    scheme = address.split("://", 1)[0].lower() if "://" in address else None
    if scheme in ("http", "https"):
        return ("is a dashboard address, which Ray Jobs (`elastic submit --address`) takes; the Trainer joins "
                "the cluster itself")
    if scheme == "ray" and not address.startswith("ray://"):
        # Ray reads the scheme as a module to import ("Module: RAY does not exist"): no setting named.
        return "has its scheme in capitals, which Ray reads as a module's name (write ray:// in lower case)"
    if scheme not in (None, "ray") or host_port(address) is None:
        return "is not a Ray address"
    return None


def unreachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing answers at ``address`` (a TCP connect), or None when something does. "auto"
    is probed where Ray resolves it (``recorded_cluster``); "local" names no cluster."""
    if address == "local":
        return None
    if address == "auto":
        return _recorded_cluster_problem(timeout_s)
    hp = host_port(address)
    if hp is None:
        return "not HOST:PORT"
    return _connect_problem(hp, timeout_s)


def _connect_problem(hp: tuple[str, int], timeout_s: float) -> str | None:
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def _recorded_cluster_problem(timeout_s: float) -> str | None:
    """Why nothing answers at the cluster "auto" names, or None. Resolved as ``ray.init`` does
    (RAY_ADDRESS; else the address ``ray start`` recorded in Ray's temp dir, else a GCS process
    running here). Why: a cluster stopped uncleanly (killed, its machine or container restarted
    with /tmp kept) leaves its address recorded, and ``ray.init("auto")`` retried it for a minute
    while Ray's core logged each try; with none found it raised a bare ConnectionError."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # a private helper: if it moves, ray.init resolves "auto" unchecked
        return None
    try:
        resolved = canonicalize_bootstrap_address("auto")
    except ConnectionError:
        return "no running Ray cluster was found: none recorded by `ray start`, and no Ray process on this machine"
    except Exception:  # noqa: BLE001 - Ray's resolution failed in a way it will report itself
        return None
    hp = host_port(resolved) if resolved else None
    if hp is None:
        return None
    reason = _connect_problem(hp, timeout_s)
    if reason is None:
        return None
    return (f"{reason} at {resolved}, the cluster Ray recorded as the last one started here (a cluster stopped "
            "uncleanly leaves its address in Ray's temp dir)")
