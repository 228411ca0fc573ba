"""The set of worker actors of one run: placement, rank order, rendezvous, spares.

``WorkerGroup`` is the controller's only seam to Ray actors. It places the active ranks in one
placement group (one bundle per rank, the user's strategy) and every hot spare in a placement
group of its own, so a replacement spare can be asked for at any time. It never decides anything:
the controller tells it which actor becomes which rank.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic.actors.cluster_fit import _draining_nodes, bundles_on
from elastic.actors.names import free_actor_name
from elastic.actors.protocol import PackedSpec, StopRequested, TrainingSpec, WorkerError
from elastic.actors.worker import TrainWorker
from elastic.config import ConfigError, ScalingConfig

logger = logging.getLogger(__name__)

# Ray's default node label, the node's ID (``ray.util.placement_group.NODE_ID_LABEL_KEY``).
# Placement groups honour ``bundle_label_selector`` from Ray 2.50 on (before, ray-project/ray
# #55590: the selector was stored but not checked when bundles were placed; fixed by #55599),
# one reason pyproject.toml asks for a recent Ray (ray>=2.52: token authentication came then).
NODE_ID_LABEL = "ray.io/node-id"
# How long a spare a recovery is waiting for may stay unplaced while it avoids a node, before
# it is asked for on any node (see ``WorkerGroup.collect_spares``).
AVOID_GRACE_S = 5.0
# The longest a blocking wait goes without looking whether a stop was asked for.
STOP_POLL_S = 0.25
MOVE_CHECK_S = 2.0  # a blocking wait for spares looks for placed free bundles this often
# A node whose raylet timed out twice in a row is not probed again for this long (_placed_free_bundle).
SILENT_NODE_S = 10.0


class PlacementTimeout(RuntimeError):
    """The cluster could not host the requested bundles within the configured wait."""


class PlacementRefused(RuntimeError):
    """Ray refused to create the ranks' placement group (a name still taken, the GCS's error).
    Not a Ray error on purpose: the start reads every Ray error as a rank lost, and started
    again ``max_failures`` times on a refusal that came back each time."""


OWNER_TAG_CHARS = 16  # of the creator's actor ID in a placement group's name (placement_owner_tag)
_GROUP_SEQ = itertools.count()  # this process's WorkerGroups, in the names of their placement groups


def placement_owner_tag(actor_id: str | None = None) -> str:
    """The part of a placement group's name that says which controller made it: the start of
    its actor ID (``actor_id``; default: this process's actor's, or a random one outside an
    actor). The driver, knowing its controller's ID, removes only that controller's groups
    after it dies (``remove_run_placement_groups``)."""
    if actor_id is None:
        actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
    return (actor_id or uuid.uuid4().hex)[:OWNER_TAG_CHARS]


_IMPORT_HINT = ("The workers unpickle model_fn, optimizer_fn, dataset_fn and loss_fn, so they import the "
                "modules those come from. Ray gives workers the driver script's directory; anything else "
                "must be installed on every node or shipped with the job: `ray job submit --working-dir .`, "
                "or ray.init(runtime_env={'working_dir': ...} or {'py_modules': [...]}) before fit().")


def describe_worker_failure(exc: BaseException, what: str) -> str:
    """``exc`` (the RayActorError of a failed constructor, or the RayTaskError of a failed call)
    as ``what``, the worker's exception line, a hint for an import error, then the worker's
    traceback. Ray carries a failed constructor's exception only as text (``error_msg``: a header
    line, the traceback, the exception line last), and a failed call's text has the same shape,
    so the text is what is read; text of another shape is given whole."""
    text = str(getattr(exc, "error_msg", "") or exc)
    lines = text.splitlines()[1:]
    while lines and not lines[0].strip(" ^"):  # position markers left from frames Ray cut
        lines.pop(0)
    body = [line for line in lines if line.strip()]
    if not body or body[-1].startswith((" ", "Traceback")):
        return f"{what}: {text}"
    summary = body[-1]
    hint = f"\n{_IMPORT_HINT}" if summary.startswith(("ModuleNotFoundError", "ImportError")) else ""
    return f"{what}: {summary}{hint}\n--- worker traceback ---\n" + "\n".join(lines)


@dataclass
class Member:
    """One actor: an active rank or a spare."""

    actor: Any
    name: str
    info: dict = field(default_factory=dict)
    pg: PlacementGroup | None = None
    bundle_index: int = 0  # its bundle in ``pg``
    rank: int = -1
    local_rank: int = 0
    node_rank: int = 0
    spare: bool = False


def unreachable_nodes(node_ids: set, timeout_s: float = 1.0, certain: set | None = None) -> set:
    """Those of ``node_ids`` whose raylet is marked dead, unknown, or does not take a TCP
    connection within ``timeout_s``. ``certain``, if given, gets those of them that are down
    for good: marked dead, unknown, or refusing. A timeout is not: one SYN lost to a healthy
    raylet (Linux sends the first again after 1 s) fails a 1 s connect."""
    down = set(node_ids)
    timed_out = set()
    for node in ray.nodes():
        if node.get("NodeID") in down and node.get("Alive"):
            try:
                with socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])),
                                              timeout=timeout_s):
                    down.discard(node["NodeID"])
            except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
                timed_out.add(node["NodeID"])
            except OSError:
                pass
    if certain is not None:
        certain |= down - timed_out
    return down


def wait_refs(refs: list, timeout_s: float, interrupted=lambda: False) -> list:
    """``ray.wait`` for every one of ``refs`` up to ``timeout_s``, in slices of ``STOP_POLL_S``
    that end the wait early once ``interrupted()``; returns the ready ones."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    pending, ready = list(refs), []
    while pending:
        left = deadline - time.monotonic()
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(STOP_POLL_S, left)))
        ready += done
        if left <= STOP_POLL_S or interrupted():
            break
    return ready


def _wait_ready(pg: PlacementGroup, timeout_s: float, what: str, interrupted=lambda: False) -> None:
    if not wait_refs([pg.ready()], timeout_s, interrupted):
        if interrupted():
            raise StopRequested(f"stopped while placing {what}")
        remove_placement_group(pg)
        raise PlacementTimeout(
            f"{what} could not be placed within {timeout_s:g}s (ScalingConfig.placement_timeout_s): the cluster "
            "does not have the free resources for this strategy. Use fewer workers, smaller "
            "resources_per_worker, a looser placement_strategy (PACK/SPREAD), or add nodes."
        ) from None


class WorkerGroup:
    """Creates, orders and tears down worker actors."""

    def __init__(self, scaling: ScalingConfig, spec: TrainingSpec | PackedSpec, namespace: str):
        self.scaling = scaling
        self.spec = spec
        self.namespace = namespace  # "elastic-<run>": actors are "rank-3", "spare-0" in it
        # Its placement groups are "<namespace>/<owner>.<n>/ranks" and ".../spare-<i>": the
        # controller that made them, and which of its groups. Why not "<namespace>/ranks": a
        # name Ray still holds (a group of an earlier group or controller, removed but not yet
        # gone, or not removed when a removal failed) refused the next one, a spare's as a rank
        # lost; and a driver whose controller died could only sweep every group of the run's
        # name, another driver's new run of that name among them once the name was free.
        self.placement_prefix = f"{namespace}/{placement_owner_tag()}.{next(_GROUP_SEQ)}"
        self.members: list[Member] = []  # index == rank
        self.spares: list[Member] = []
        self._pgs: list[PlacementGroup] = []
        # The ranks' placement group, and bundle -> the name of the actor placed in it. A bundle
        # with no holder is free (its rank lost, evicted or shrunk away, or a spare placed there
        # lost): see ``request_spare``. A release frees a bundle only for its holder, so releasing
        # a member twice (evicted, then replaced) cannot free it under a spare placed there since.
        self._ranks_pg: PlacementGroup | None = None
        self._bundle_holder: dict[int, str] = {}
        self._spare_counter = 0
        self._pending_spares: list[Member] = []
        self._newly_ready: list[Member] = []  # built since the last take_newly_ready
        self.dataset_size: int | None = None  # the ranks' (all equal), once they are built
        # (event kind, message) about spares, for the controller's event log (take_spare_notes):
        # "spare_lost" (died before it was ready), "spare_rejected" (not used), "spares" (other).
        self.spare_notes: list[tuple[str, str]] = []
        self._spare_beats: dict[str, tuple[Any, float]] = {}  # ready spare -> (heartbeat ref, when asked)
        self._actor_cls = ray.remote(concurrency_groups={"control": 1})(TrainWorker)
        # The controller's "was a stop asked for?": blocking waits here end early when it says so.
        self.interrupted: Any = lambda: False
        # The controller's nodes spares stay off now (a straggler was evicted there): a pending
        # spare moved into a freed bundle keeps off them too, not only off those of its request.
        self.nodes_to_avoid: Any = lambda: ()
        # Nodes whose raylet refused a connection while Ray still listed them alive: never used
        # again (a node ID is not reused; a node that comes back is a new one). Not one that
        # only timed out (``unreachable_nodes``' ``certain``): skipped for that look only.
        self._down_nodes: set[str] = set()
        self._silent_nodes: dict[str, float] = {}  # node -> until when (monotonic) it is not probed again
        self._timed_out: dict[str, int] = {}  # node -> its raylet's connects timed out in a row

    # ---- creation --------------------------------------------------------------------------
    def _options(self, pg: PlacementGroup, bundle_index: int, name: str) -> dict:
        bundle = self.scaling.bundle()
        # Ray takes CPU, GPU and memory as arguments of their own and refuses them inside
        # ``resources=`` (ValueError at .remote()); a bundle may hold any of them
        # (object_store_memory, the other such key, is refused by ScalingConfig).
        opts = dict(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
            **({"memory": bundle["memory"]} if "memory" in bundle else {}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_index
            ),
            name=name,
            namespace=self.namespace,
            lifetime=None,
            max_restarts=0,
            max_task_retries=0,
        )
        return opts

    def _spawn(self, pg: PlacementGroup, index: int, name: str, background: bool = False) -> Any:
        options = self._options(pg, index, name)
        try:
            return self._actor_cls.options(**options).remote(self.spec, name, background)
        except ray.exceptions.ActorAlreadyExistsError:
            # The actor of this name in the group before this one (a restart killed every rank
            # and spare, and the new group uses their names again), not yet marked dead: the
            # whole restart failed on it when the new placement was ready at once.
            free_actor_name(name, self.namespace)
            return self._actor_cls.options(**options).remote(self.spec, name, background)

    def start(self, num_active: int) -> None:
        """Place and start the active ranks plus the hot spares, then order ranks by node."""
        bundle = self.scaling.bundle()
        name = f"{self.placement_prefix}/ranks"
        try:
            pg = placement_group([dict(bundle) for _ in range(num_active)], strategy=self.scaling.placement_strategy,
                                 name=name)
        except ray.exceptions.RaySystemError as exc:
            raise PlacementRefused(f"Ray refused to create the ranks' placement group {name!r}: {exc}") from exc
        self._pgs.append(pg)
        self._ranks_pg = pg
        _wait_ready(pg, self.scaling.placement_timeout_s, f"{num_active} worker bundles {bundle}", self.interrupted)
        # Ranks follow the nodes the bundles landed on, so actor "rank-i" really is rank i.
        bundle_nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        node_order: dict[str, int] = {}
        for i in range(num_active):
            node_order.setdefault(bundle_nodes.get(i, ""), len(node_order))
        by_node = sorted(range(num_active), key=lambda i: node_order[bundle_nodes.get(i, "")])
        pending: list[Member] = []
        try:
            # Inside the try: a spawn that raises (a name still taken after free_actor_name's
            # wait) left the ranks spawned before it to the removal of their group.
            for r, b in enumerate(by_node):
                pending.append(Member(self._spawn(pg, b, f"rank-{r}"), f"rank-{r}", pg=pg, bundle_index=b))
            self._bundle_holder = {m.bundle_index: m.name for m in pending}
            # The spares off the ranks' nodes where another node has room for one: a spare on a
            # rank's node dies with it, and the node's loss then finds no spare (a wait for
            # capacity or a restart from the checkpoint, not one step). Where no other node could
            # host one (one node, or the others too small) they go anywhere (_avoidable), and one
            # still unplaced after AVOID_GRACE_S (at most placement_timeout_s: the start's wait
            # below and a recovery's; placement_timeout_s in the background) is asked for anywhere.
            # And off a straggler's node (``nodes_to_avoid``): a restart from the checkpoint after
            # an eviction built its pool there as well, a spare as slow as the rank evicted. Where
            # no node is off both, off the straggler's still.
            rank_nodes = sorted({node for node in bundle_nodes.values() if node})
            avoid = sorted(set(rank_nodes) | set(self.nodes_to_avoid()))
            if not self._avoidable(avoid):
                avoid = sorted(set(self.nodes_to_avoid()))
            for _ in range(self.scaling.num_hot_spares):
                self.request_spare(avoid_nodes=avoid)
            # Every rank builds at once; each is taken as it is built, so a rank that fails to
            # build is told at once, not after the slowest model_fn or dataset_fn. No time limit
            # (a big model or dataset may take long to build), but a stop ends the wait: Ctrl-C
            # during a stuck build (a download, a mount) stopped the run only once every rank
            # was built.
            waiting = {m.actor.info.remote(): rank for rank, m in enumerate(pending)}
            while waiting:
                done, _ = ray.wait(list(waiting), num_returns=1, timeout=STOP_POLL_S)
                for ref in done:
                    rank = waiting.pop(ref)
                    try:
                        pending[rank].info = ray.get(ref)
                    except ray.exceptions.RayActorError as exc:
                        if not getattr(exc, "actor_init_failed", False):
                            raise
                        raise WorkerError(rank, describe_worker_failure(exc, "could not be built")) from None
                if waiting and not done and self.interrupted():
                    raise StopRequested(f"stopped while rank(s) {sorted(waiting.values())} built their model "
                                        "and dataset")
            self._check_same_dataset(pending)  # inside: ranks of a refused start are killed like any
        except BaseException:
            # The ranks started so far are no members yet, so shutdown() would leave them to the
            # removal of their placement group, which frees their names only once Ray has seen
            # them die: a start begun again (elastic/controller.py, _start) could find the names
            # taken. Killed here, they go now.
            for m in pending:
                try:
                    ray.kill(m.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - dead already, or its node gone: nothing to free
                    logger.debug("kill of %s failed", m.name, exc_info=True)
            raise
        self.members = order_by_node(pending)
        self._name_ranks()
        # The spares that found room build beside the ranks, ready for the first failure; one
        # that did not place by now waits for room in the background (collect_spares).
        self.collect_spares(block=True, placed_only=True)

    def _check_same_dataset(self, members: list[Member]) -> None:
        """Every rank must build the same dataset: the controller hands out sample indices into it.
        Its size is what can be checked for free; a node with part of the data, or a dataset_fn
        that is not deterministic, shows there. Otherwise a rank would fail mid-run on an index
        past its end, or train quietly on other samples than the ones accounted for."""
        sizes = {m.name: m.info.get("dataset_size") for m in members if m.info.get("dataset_size") is not None}
        if len(set(sizes.values())) > 1:
            rows = "; ".join(f"{m.name} on node {m.info.get('node_ip')}: {sizes[m.name]} samples"
                             for m in members if m.name in sizes)
            raise ConfigError(f"dataset_fn built datasets of different sizes on the workers ({rows}). Every "
                              f"worker must build the same dataset (the controller hands out sample indices "
                              f"into it): make dataset_fn deterministic and the data complete on every node.")
        self.dataset_size = next(iter(sizes.values()), None)

    def _name_ranks(self) -> None:
        # Actor names are fixed at creation; the rank->name map lives in info for the CLI.
        for rank, m in enumerate(self.members):
            m.rank = rank
            m.spare = False
        assign_local_ranks(self.members)

    def request_spare(self, background: bool = False, avoid_nodes: Iterable[str] = ()) -> list[str]:
        """Start one more hot spare in its own placement group, without waiting for it.

        ``background``: the spare only refills the pool while ranks train, so it builds on idle
        CPU (``ScalingConfig.background_spare_start`` permitting). A spare that a recovery waits
        for starts at normal priority.

        ``avoid_nodes``: node IDs the spare should not land on (a straggler was evicted there). Its
        bundle then carries a label selector on Ray's node-ID label, ``!in(...)``, so Ray places it
        on another node. Only when another live node could host the bundle at all; on a cluster of
        one node, or when every other node is too small, the spare is placed as usual. Returns the
        nodes avoided. A spare still unplaced after ``placement_timeout_s`` (the other nodes stay
        full) is asked for again without the selector (``collect_spares``).

        A bundle of the ranks' placement group whose actor is gone is used first. Why: Ray frees a
        bundle only with its whole group, so a lost or evicted rank's CPU or GPU stayed reserved
        and idle for the rest of the run, while its replacement spare asked the cluster for one
        more. On a cluster sized for ranks plus spares (8 GPUs: 7 ranks and a spare) the refill
        then never placed, and the next failure found no spare. After a node loss, Ray places that
        bundle again on a live node (when one has room), and the spare waits for it there. A free
        bundle on a node to avoid is left for a later spare."""
        avoid = self._avoidable(avoid_nodes)
        idx = self._spare_counter
        self._spare_counter += 1
        name = f"spare-{idx}"
        index = self._free_bundle_off(avoid, holder=name)
        if index is not None:
            pg, avoid = self._ranks_pg, []
        else:
            pg, index = self._spare_group(idx, avoid), 0
        member = Member(None, name, pg=pg, bundle_index=index, spare=True)
        try:
            member.actor = self._spawn(pg, index, name, background and self.scaling.background_spare_start)
        except BaseException:
            self._free_placement(member)  # held by no actor: the bundle free again, a group of its own removed
            raise
        member.info = {"_ref": member.actor.info.remote(), "_pg_ready": pg.ready(), "_since": time.time(),
                       "_avoid": avoid, "_background": background}
        self._pending_spares.append(member)
        return avoid

    def _spare_group(self, idx: int, avoid: list[str]) -> PlacementGroup:
        """A placement group of its own for spare ``idx``, kept off ``avoid`` (a node-ID label selector)."""
        selector = [{NODE_ID_LABEL: f"!in({','.join(avoid)})"}] if avoid else None
        pg = placement_group([self.scaling.bundle()], strategy="PACK", name=f"{self.placement_prefix}/spare-{idx}",
                             bundle_label_selector=selector)
        self._pgs.append(pg)
        return pg

    @property
    def _free_bundles(self) -> list[int]:
        """The ranks' group's bundles with no actor in them."""
        count = len(self._ranks_pg.bundle_specs) if self._ranks_pg is not None else 0
        return [i for i in range(count) if i not in self._bundle_holder]

    def _free_bundle_off(self, avoid_nodes: Iterable[str], holder: str = "") -> int | None:
        """A free bundle of the ranks' group, now held by ``holder``, placed on a live node not in
        ``avoid_nodes`` (those ``_avoidable`` kept: on a cluster of one node, none).

        Only a bundle placed now: one lost with its node waits for Ray to place it again, which
        under the group's strategy may never happen (STRICT_SPREAD allows no node that holds
        another of its bundles), and a spare put there would wait with it, counted as pending,
        while a group of its own could have placed. It stays on the free list for a later spare,
        once Ray has placed it."""
        i = self._placed_free_bundle(avoid_nodes)
        if i is not None:
            self._bundle_holder[i] = holder
        return i

    def _placed_free_bundle(self, avoid_nodes: Iterable[str]) -> int | None:
        """A free bundle of the ranks' group placed now on a live node not in ``avoid_nodes``.

        Live: listed alive by Ray and its raylet accepting a connection. Why both: the GCS marks a
        node dead only once its health checks have failed (~15 s with Ray's defaults), and a
        recovery is over in a few seconds. Right after a node loss, the lost rank's freed bundle
        is still "placed" on the dead node, and its refill spare was put there, to wait with the
        bundle (counted as pending, so no other spare was asked for) or die as spare_lost."""
        free = self._free_bundles
        if not free:
            return None
        avoid = set(avoid_nodes)
        nodes = ray.util.placement_group_table(self._ranks_pg).get("bundles_to_node_id", {})
        now = time.monotonic()
        self._silent_nodes = {n: until for n, until in self._silent_nodes.items() if until > now}
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")} - self._down_nodes - set(self._silent_nodes)
        for i in free:
            node = nodes.get(i)
            if node not in alive or node in avoid:
                continue
            if not self._raylet_answers(node, now):
                alive.discard(node)
                continue
            return i
        return None

    def _raylet_answers(self, node: str, now: float) -> bool:
        """Whether ``node``'s raylet takes a connection, noting one that does not.

        Kept out for good only when down for certain (refusing, dead or unknown): one connect
        that timed out (a SYN lost) kept a healthy node's freed bundles unused for the rest of
        the run, and the refill spares waited for room that never came. One that timed out
        twice in a row is skipped for SILENT_NODE_S: a node that died outright (power lost) does
        not refuse, it is silent until the GCS marks it dead (~15-30 s), and each look (a
        recovery's every 2 s, training's every few steps) spent a second on it. Not after one:
        a healthy node's lost SYN then kept its bundle out of a wait for capacity as long as
        the wait (capacity_timeout_s, 30 s)."""
        certain: set = set()
        if not unreachable_nodes({node}, certain=certain):
            self._timed_out.pop(node, None)
            return True
        self._down_nodes |= certain
        if node not in certain:
            self._timed_out[node] = self._timed_out.get(node, 0) + 1
            if self._timed_out[node] >= 2:
                self._silent_nodes[node] = now + SILENT_NODE_S
                self._timed_out[node] = 0
        return False

    def _move_to_placed_free_bundles(self, urgent: bool = False) -> None:
        """Spares still waiting for room in a placement group of their own, asked for again in a
        free bundle of the ranks' group once Ray has placed one (``request_spare`` takes it).
        ``urgent``: a recovery waits for them (``collect_spares(block=True)``), so the new one
        starts at normal priority (see ``_again_in_background``).

        Why: after a node loss, the lost rank's bundle waits for Ray to place it again, so its
        refill spare asks for a group of its own. When a node joins (the cluster's autoscaler or
        KubeRay replacing the lost one), Ray places the rescheduled bundle first (the GCS puts a
        group being rescheduled ahead of pending ones): on a cluster sized for ranks plus spares
        the new node's room goes to the bundle, and the spare's own group never places. Without
        this move the spare stayed pending for the rest of the run, counted as building, and the
        next failure waited out capacity_timeout_s for it."""
        if not self._free_bundles:
            return
        for m in list(self._pending_spares):
            if m.pg is None or m.pg is self._ranks_pg:
                continue
            if self._placed(m):
                continue  # placed: it is building
            # Off the nodes avoided when it was asked for and those avoided since (a straggler
            # evicted meanwhile, whose freed bundle would otherwise be the one found here).
            avoid = sorted(set(m.info.get("_avoid", [])) | set(self.nodes_to_avoid()))
            if self._placed_free_bundle(avoid) is None:
                continue  # none off this one's avoided nodes; another spare may avoid none
            self._pending_spares.remove(m)
            self._release(m)
            self._note_spare("spares", f"{m.name} was still waiting for room, and a bundle of the ranks' group "
                             "freed by a lost rank is placed now: asking for the spare there")
            self.request_spare(background=self._again_in_background(m, urgent), avoid_nodes=avoid)

    @staticmethod
    def _again_in_background(m: Member, urgent: bool) -> bool:
        """Whether a spare asked for again in ``m``'s place builds on idle CPU: as ``m`` did,
        unless a wait needs it now. Why: a background refill re-asked during a recovery's wait
        for capacity kept its idle priority, and the ranks' idle CPU is all it gets only while
        nothing else on the node runs (a checkpoint agent, another job's tasks); starved, the
        wait ran out and the run fell back to ``when_no_spare``."""
        return m.info["_background"] and not urgent

    def _avoidable(self, avoid_nodes: Iterable[str]) -> list[str]:
        """``avoid_nodes`` (sorted) if some other live node has the resources of a bundle, else [].
        Not a draining node (Ray places nothing new there, as ``cluster_fit.live_capacity`` has
        it) nor one known down: counted as room, the spare kept off the others waited out its
        grace (``placement_timeout_s`` in the background) for a node that could never take it."""
        avoid = sorted(set(avoid_nodes))
        if not avoid:
            return []
        bundle = self.scaling.bundle()
        unusable = set(avoid) | self._down_nodes | _draining_nodes()
        for node in ray.nodes():
            if node.get("Alive") and node.get("NodeID") not in unusable and bundles_on(node.get("Resources", {}), bundle):
                return avoid
        return []

    def _place_anywhere_if_stuck(self, grace_s: float, wait: bool) -> None:
        """Spares kept off some nodes whose placement group is still not placed ``grace_s`` after
        the request: ask for them again without the selector, since a spare on a node we would
        rather avoid beats no spare. ``wait``: wait out each one's grace (a recovery needs it)."""
        for m in list(self._pending_spares):
            if not m.info.get("_avoid"):
                continue
            deadline = m.info["_since"] + grace_s
            placed = wait_refs([m.info["_pg_ready"]], max(0.0, deadline - time.time()) if wait else 0, self.interrupted)
            if placed or time.time() < deadline:
                continue  # placed (it is building), or still has time
            self._pending_spares.remove(m)
            self._release(m)
            self._note_spare("spares", f"{m.name} found no room off node(s) {', '.join(n[:12] for n in m.info['_avoid'])} "
                             f"within {grace_s:g}s; asking for a spare on any node")
            self.request_spare(background=self._again_in_background(m, urgent=wait))

    def _note_spare(self, kind: str, message: str) -> None:
        logger.warning("%s", message)
        self.spare_notes.append((kind, message))

    def take_spare_notes(self) -> list[tuple[str, str]]:
        """What happened to spares since the last call, as (event kind, message), oldest first."""
        notes, self.spare_notes = self.spare_notes, []
        return notes

    def take_newly_ready(self) -> list[Member]:
        """Spares whose model was built since the last call (a rank standing by after a shrink
        is none: it joined the pool built), oldest first."""
        ready, self._newly_ready = self._newly_ready, []
        return ready

    def collect_spares(self, block: bool = False, timeout_s: float | None = None, enough: int | None = None,
                       placed_only: bool = False) -> int:
        """Move spares whose model is built into the ready list; returns how many are ready.

        ``block``: wait for the pending spares (up to ``timeout_s``, default
        ``placement_timeout_s``); a spare still kept off a node gets ``AVOID_GRACE_S`` to be
        placed (not ``placement_timeout_s``) before it is asked for anywhere. ``enough``: the
        wait ends once that many are ready (a recovery needs as many as it lost, not every spare
        asked for: one still waiting for room kept a spare in hand idle for the whole
        ``capacity_timeout_s``). ``placed_only``: wait only for spares whose placement group is
        placed, i.e. building their model; one still waiting for room goes on in the background
        (the start: only the ranks must fit, spares may wait for capacity an autoscaler adds)."""
        self._place_anywhere_if_stuck(min(AVOID_GRACE_S, self.scaling.placement_timeout_s) if block
                                      else self.scaling.placement_timeout_s, wait=block)
        deadline = time.time() + (timeout_s if timeout_s is not None else self.scaling.placement_timeout_s)
        while True:
            # Again every slice of a blocking wait: a node joining during a wait for capacity is
            # when a lost rank's bundle is placed again (_move_to_placed_free_bundles).
            self._move_to_placed_free_bundles(urgent=block)
            self._take_built_spares()
            left = deadline - time.time()
            waiting = [m for m in self._pending_spares if not placed_only or self._placed(m)]
            if (not block or not waiting or left <= 0 or self.interrupted()
                    or (enough is not None and len(self.spares) >= enough)):
                return len(self.spares)
            wait_refs([m.info["_ref"] for m in waiting], min(left, MOVE_CHECK_S), self.interrupted)

    @staticmethod
    def _placed(m: Member) -> bool:
        """Whether a pending spare's placement group is placed (the spare is building)."""
        return bool(wait_refs([m.info["_pg_ready"]], 0))

    def _take_built_spares(self) -> None:
        """Move pending spares whose model is built (or that failed) out of the pending list."""
        still = []
        for m in self._pending_spares:
            ref = m.info["_ref"]
            ready = wait_refs([ref], 0)
            if ready:
                try:
                    m.info = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    self._note_spare("spare_lost", describe_worker_failure(exc, f"{m.name} died before it was ready"))
                    self._release(m)
                    continue
                size = m.info.get("dataset_size")
                if None not in (size, self.dataset_size) and size != self.dataset_size:
                    # Never a rank: see _check_same_dataset. The controller logs the refusal.
                    self._note_spare("spare_rejected", f"{m.name} on node {m.info.get('node_ip')} built a dataset of "
                                     f"{size} samples, the ranks' has {self.dataset_size}: not used (dataset_fn must "
                                     f"build the same dataset on every node)")
                    self._release(m)
                    continue
                self.spares.append(m)
                self._newly_ready.append(m)
            else:
                still.append(m)
        self._pending_spares = still

    @property
    def pending_spares(self) -> int:
        return len(self._pending_spares)

    @property
    def building_spares(self) -> list[Member]:
        """Spares asked for and not ready yet (placing, or building their model)."""
        return list(self._pending_spares)

    def watch_spares(self, silent_after_s: float, wait: bool = False) -> list[tuple[Member, str]]:
        """Check the ready spares: each call reads the heartbeat the previous call asked each spare
        for, and asks for the next one. A spare whose heartbeat failed (the actor or its node died)
        or that has not answered for ``silent_after_s`` is released and dropped from the pool;
        returns those spares with what happened to each.

        Without ``wait`` (while ranks train) it never blocks: an answer not in yet is read next
        time. Why between failures, and not only when a failure needs a spare: a spare that died
        unnoticed counts as ready until the next failure finds it dead, and that failure then
        waits for a new spare to be built (``when_no_spare``), the seconds a hot spare exists to
        save. Checked this way it costs one small actor call per spare per check.

        ``wait`` (a recovery or an eviction about to use the pool): every spare is asked now,
        answers are waited for up to ``silent_after_s``, and a spare that gives none is silent.
        A question asked earlier and already answered well is asked again: that answer may be
        from before the spare died (a pool watched every few steps), and the spare about to be
        promoted must be alive now. One answered with an error is read below, as lost."""
        now = time.time()
        if wait:
            for m in self.spares:
                old = self._spare_beats.get(m.name)
                if old is not None and ray.wait([old[0]], timeout=0)[0]:
                    try:
                        ray.get(old[0])
                    except ray.exceptions.RayError:
                        continue
                    del self._spare_beats[m.name]
                self._spare_beats.setdefault(m.name, (m.actor.heartbeat.remote(), now))
        asked = {m.name: self._spare_beats[m.name] for m in self.spares if m.name in self._spare_beats}
        answered: set = set()
        if asked:
            refs = [ref for ref, _ in asked.values()]
            answered = set(ray.wait(refs, num_returns=len(refs), timeout=silent_after_s if wait else 0)[0])
            now = time.time()
        lost: list[tuple[Member, str]] = []
        keep: list[Member] = []
        for m in self.spares:
            ref, since = asked.get(m.name, (None, now))
            if ref is not None and ref in answered:
                try:
                    ray.get(ref)
                    ref = None
                except ray.exceptions.RayError as exc:
                    lost.append((m, f"died ({type(exc).__name__})"))
                    continue
            elif ref is not None and (wait or now - since > silent_after_s):
                lost.append((m, f"did not answer a heartbeat for {now - since:.0f}s"))
                continue
            if ref is None:
                self._spare_beats[m.name] = (m.actor.heartbeat.remote(), now)
            keep.append(m)
        self.spares = keep
        for m, _ in lost:
            self._spare_beats.pop(m.name, None)
            self._release(m)
        return lost

    # ---- membership changes ----------------------------------------------------------------
    def promote_spare(self, rank: int, avoid_nodes: Iterable[str] = ()) -> Member:
        """The next ready spare takes over ``rank``: the oldest one not on ``avoid_nodes`` (nodes
        a straggler was evicted from), else the oldest."""
        avoid = set(avoid_nodes)
        spare = self.spares.pop(next((i for i, m in enumerate(self.spares) if m.info.get("node_id") not in avoid), 0))
        self._spare_beats.pop(spare.name, None)
        if rank < len(self.members):
            self._release(self.members[rank])  # lost or evicted: its bundle is free for a spare
        spare.spare = False
        spare.rank = rank
        self.members[rank] = spare
        assign_local_ranks(self.members)
        return spare

    def remove_ranks(self, ranks: list[int], stand_by: Iterable[int] = ()) -> None:
        """Shrink: drop ``ranks`` and renumber the rest in order. The members ranked ``stand_by``
        join the ready spares instead of being released: they have left the group like every
        survivor of a failure, and a promotion brings a spare's state up to date either way.
        They keep their bundles, so a spare asked for later does not take them."""
        gone, idle = set(ranks), set(stand_by)
        for m in self.members:
            if m.rank in gone:
                self._release(m)
            elif m.rank in idle:
                m.spare, m.rank = True, -1
                self.spares.append(m)
        self.members = [m for m in self.members if m.rank not in gone and not m.spare]
        self._name_ranks()

    def evict(self, member: Member) -> None:
        self._release(member)

    def _release(self, member: Member) -> None:
        try:
            ray.kill(member.actor, no_restart=True)
        except Exception:
            logger.debug("kill of %s failed", member.name, exc_info=True)
        self._free_placement(member)

    def _free_placement(self, member: Member) -> None:
        """``member``'s place given back: its bundle of the ranks' group free for another actor,
        or the placement group made for it alone removed."""
        if member.pg is not None and member.pg is self._ranks_pg:
            if self._bundle_holder.get(member.bundle_index) == member.name:
                del self._bundle_holder[member.bundle_index]
        elif member.pg is not None and member.pg in self._pgs:
            self._pgs.remove(member.pg)
            try:
                remove_placement_group(member.pg)
            except Exception:
                logger.debug("removing the placement group of %s failed", member.name, exc_info=True)

    def shutdown(self) -> None:
        for m in self.members + self.spares + self._pending_spares:
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception:
                logger.debug("kill of %s failed", m.name, exc_info=True)
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                logger.debug("remove_placement_group failed", exc_info=True)
        self.members, self.spares, self._pending_spares, self._pgs = [], [], [], []
        self._ranks_pg, self._bundle_holder = None, {}


def remove_run_placement_groups(namespace: str, owner: str | None = None) -> list[str]:
    """Remove the placement groups of the run whose actors live in ``namespace`` ("elastic-<run>");
    returns their names. For the driver, after it killed that run's controller: with ``owner``
    (that controller's actor ID), only those that controller made (``WorkerGroup.placement_prefix``).
    Why only those: once the controller is dead its name is free, and another driver's run of
    the same name may have placed its own groups since.

    Why: the controller actor creates them, and Ray frees a placement group when its creator
    actor and its creator's job are both dead. A controller killed (a second interrupt, the
    stop timeout, a leftover of this driver's earlier fit()) skips ``WorkerGroup.shutdown``, and
    while the driver lives its groups stay: their CPUs and GPUs reserved, a next fit() of the
    same run waiting for resources that nothing uses."""
    from ray._raylet import PlacementGroupID

    prefix = f"{namespace}/" if owner is None else f"{namespace}/{placement_owner_tag(owner)}."
    removed = []
    for pg_id, row in placement_group_table().items():
        name = row.get("name") or ""
        if name.startswith(prefix) and row.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
                removed.append(name)
            except Exception:  # gone meanwhile, or the GCS refused: nothing more to do here
                logger.debug("removing placement group %s failed", name, exc_info=True)
    return removed


def order_by_node(members: list[Member]) -> list[Member]:
    """Group ranks by node, nodes in order of first appearance, so node and local ranks are right."""
    node_order: dict[str, int] = {}
    for m in members:
        node_order.setdefault(m.info["node_id"], len(node_order))
    return sorted(members, key=lambda m: node_order[m.info["node_id"]])


def assign_local_ranks(members: list[Member]) -> None:
    node_rank: dict[str, int] = {}
    local: dict[str, int] = {}
    for m in members:
        node = m.info.get("node_id", "")
        m.node_rank = node_rank.setdefault(node, len(node_rank))
        m.local_rank = local.get(node, 0)
        local[node] = m.local_rank + 1
