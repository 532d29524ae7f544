"""Remote rollout workers started, placed and restarted by Ray (``rollout.ray_address``; ``docs/ray.md`` has the
commands, the bundles, the restarts and what is verified).

The trainer connects to the cluster, reserves a placement group with one bundle per remote worker (:func:`bundle`,
strategy ``rollout.ray_strategy``) and starts each worker as a :class:`RolloutActor` on its bundle; it joins the
pool like a hand-started ``mrl worker``. With rejoinable transports each actor gets ``max_restarts =
rollout.restart_workers`` and a restarted actor joins as the next incarnation of its worker (:mod:`.remote`);
otherwise ``max_restarts = 0``. :meth:`RayLauncher.check` judges a worker whose heartbeat went silent by Ray's
view of its actor (:func:`judge`).

Ray is imported only here, inside functions. Ray's actor state comes from its GCS (``ray._private.state``, a
DeveloperAPI that needs no dashboard).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from mrl_plugins.errors import ConfigError, StageTimeoutError

from .lifecycle import signal_kept
from .pool_checks import loopback

log = logging.getLogger("mrl_plugins.rollout")

#: seconds a worker's heartbeat may stand still before the pool asks Ray about its actor
PROBE_AFTER_S = 2.0
#: at most one question to Ray per worker this often
PROBE_EVERY_S = 1.0
#: seconds to reach the cluster's head before ray.init (which retries for minutes on an address nobody serves)
CONNECT_TIMEOUT_S = 5.0
#: object store of a cluster started for the run (ray_address: local): the workers put nothing in it
LOCAL_OBJECT_STORE_BYTES = 128 << 20
#: resources of a node that are not what a bundle asks for (shown apart or not at all)
_NODE_KEYS = ("memory", "object_store_memory")


def bundle(threads: int, device_type: str, extra: dict | None = None) -> dict[str, float]:
    """One worker's bundle: its CPU threads, a GPU (CUDA) or NPU (Ascend) of its own, the custom resources."""
    out = {"CPU": float(threads)}
    if device_type == "cuda":
        out["GPU"] = 1.0
    elif device_type == "npu":
        out["NPU"] = 1.0
    out.update({k: float(v) for k, v in (extra or {}).items()})
    return out


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v - 1e-9 for k, v in need.items())


def placement_problem(bundles: list[dict[str, float]], strategy: str, nodes: list[dict]) -> str | None:
    """Why ``bundles`` can never be placed with ``strategy`` on the alive ``nodes`` (``ray.nodes()`` entries, their
    total ``Resources``), or None. Availability (what other jobs hold now) is Ray's to wait for."""
    alive = [dict(n.get("Resources") or {}) for n in nodes if n.get("Alive")]
    if not bundles:
        return None
    if strategy == "STRICT_PACK":
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        if not any(_fits(total, r) for r in alive):
            return f"no node has {_fmt(total)} for all {len(bundles)} bundles together (STRICT_PACK)"
        return None
    if strategy == "STRICT_SPREAD":
        free = [r for r in alive if _fits(bundles[0], r)]
        if len(free) < len(bundles):
            return (
                f"STRICT_SPREAD needs {len(bundles)} nodes with {_fmt(bundles[0])} each; {len(free)} of the "
                f"{len(alive)} alive nodes have it"
            )
        return None
    left = [dict(r) for r in alive]  # PACK / SPREAD: the bundles fit somewhere, one node holding several
    for k, b in enumerate(bundles):
        node = next((r for r in left if _fits(b, r)), None)
        if node is None:
            return f"bundle {k} of {len(bundles)} ({_fmt(b)}) fits on no node once the ones before it are placed"
        for key, v in b.items():
            node[key] = node.get(key, 0.0) - v
    return None


def actor_cores(cores: list[int] | None, threads: int, nodes: list[str]) -> list[list[int] | None]:
    """Per bundle, the cores its actor binds (``rollout.ray_worker_cores``): the n-th bundle on a node takes the
    n-th ``threads`` of them; None everywhere when unset. A node given more actors than the list covers is one
    ConfigError, before any actor starts. Cores a node does not have fail the actor's worker at its start (the
    compute budget's error, sent to the trainer like any worker error)."""
    if not cores:
        return [None] * len(nodes)
    out: list[list[int] | None] = []
    for k, node in enumerate(nodes):
        n = nodes[:k].count(node)
        part = list(cores[n * threads : (n + 1) * threads])
        if len(part) < threads:
            raise ConfigError(
                f"rollout.ray_worker_cores: {cores} gives {len(cores) // threads} actor(s) of engine_threads "
                f"{threads} their cores, but Ray placed {nodes.count(node)} on one node; list more cores, or "
                "keep fewer workers on a node with rollout.ray_resources (docs/ray.md)"
            )
        out.append(part)
    return out


def _fmt(resources: dict[str, float]) -> str:
    parts = [f"{k} {v:g}" for k, v in sorted(resources.items()) if not k.startswith("node:") and k not in _NODE_KEYS]
    return "{" + ", ".join(parts) + "}"


def describe_nodes(nodes: list[dict]) -> str:
    """The nodes as one line: ``ip (CPU 2, GPU 1) dead`` each."""
    out = []
    for n in nodes:
        state = "" if n.get("Alive") else " dead"
        out.append(f"{n.get('NodeManagerAddress', '?')} {_fmt(dict(n.get('Resources') or {}))}{state}")
    return "; ".join(out) or "(no nodes)"


def resolve_address(address: str) -> str | None:
    """``rollout.ray_address`` as the HOST:PORT ray.init will dial (``RAY_ADDRESS`` and the cluster started on
    this node for ``auto``, as Ray resolves it), None for ``local``; ConfigError when ``auto`` finds none."""
    if address == "local":
        return None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address)
    except ConnectionError as exc:
        raise ConfigError(_no_cluster(address, str(exc))) from None
    except Exception:  # noqa: BLE001 - Ray's own resolution moved: dial what was given
        return None if address == "auto" else address


def _no_cluster(address: str, why: str) -> str:
    return (
        f"Ray (rollout.ray_address): no Ray cluster at rollout.ray_address {address!r} ({why}); start one with "
        "`ray start --head --port 6379` on the head node and `ray start --address HEAD_IP:6379` on every worker "
        "node, then set rollout.ray_address to HEAD_IP:6379 (or 'auto' on a node of it), or ray_address: local to "
        "start a one-node cluster for this run (docs/ray.md)"
    )


def connect(address: str) -> bool:
    """Connect this process to the cluster (``ray.init``); False when it already was (the trainer runs inside a
    Ray job: that connection is used and left open). A cluster that does not answer is one ConfigError in
    ``CONNECT_TIMEOUT_S``, not minutes of ray.init's retries."""
    import ray

    if ray.is_initialized():
        return False
    target = resolve_address(address)
    if target is not None:
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as exc:
            raise ConfigError(_no_cluster(address, f"{target}: {exc}")) from None
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address == "local":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs.update(include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    with signal_kept(signal.SIGTERM):  # ray.init sets its own handler: the trainer's (the TRL adapter's) stays
        try:
            ray.init(address=target or address, **kwargs)
        except ConnectionError as exc:
            raise ConfigError(_no_cluster(address, str(exc))) from None
    return True


def _death_cause(info: dict) -> str:
    """Ray's death cause of an actor (the GCS's ``ActorDeathCause``) as one line."""
    cause = info.get("DeathCause")
    try:
        for _field, value in cause.ListFields():
            text = getattr(value, "error_message", "") or getattr(value, "formatted_exception_string", "")
            if text:  # Ray's first sentences; its list of common causes is left out
                return " ".join(str(text).split(" Some common causes")[0].split())[:600]
    except AttributeError:
        pass
    return str(cause or "no cause recorded")[:600]


def judge(
    state: str,
    *,
    restarting: bool,
    joined: bool,
    silent: float,
    waiting: float,
    pg_state: str,
    timeout_s: float,
    start_timeout_s: float,
) -> str:
    """What the pool makes of a Ray worker whose heartbeat it cannot see: ``dead`` (Ray gave up on the actor),
    ``unplaceable`` (Ray restarts it but its placement group has waited ``waiting`` > ``timeout_s`` for a node with
    room: RESCHEDULING), ``late`` (starting or restarting for longer than ``start_timeout_s``), ``silent`` (Ray
    reports it up but its heartbeat stood still for ``timeout_s``: a cut link, a hang, a node Ray has not missed
    yet) or ``ok`` (alive, or coming up within its time). ``restarting``: Ray restarted it since its last join;
    ``joined``: the incarnation the pool serves connected."""
    if state == "DEAD":
        return "dead"
    if not joined or restarting:
        if waiting > timeout_s and pg_state == "RESCHEDULING":
            return "unplaceable"
        return "late" if waiting > start_timeout_s else "ok"
    return "silent" if silent > timeout_s else "ok"


class RolloutActor:
    """A remote rollout worker inside a Ray actor: ``mrl worker --connect address --index index`` (``serve``) in a
    thread, started by the constructor, so a restarted actor (Ray runs the constructor again in a new process)
    joins the pool by itself as its worker's next incarnation. ``ray.remote`` is applied by :class:`RayLauncher`;
    this module imports no Ray at import time."""

    def __init__(
        self, address: str, index: int, device: str, threads: int, timeout: float, cores: list[int] | None = None
    ) -> None:
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._serve, args=(address, index, device, threads, timeout, cores),
            name=f"mrl-ray-worker-{index}", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _serve(
        self, address: str, index: int, device: str, threads: int, timeout: float, cores: list[int] | None
    ) -> None:
        try:
            from .remote import serve

            serve(address, index, device=device, threads=threads, timeout=timeout, cores=cores)
        except BaseException as exc:  # noqa: BLE001 - a worker error also went to the trainer (its error queue)
            self.error = f"{type(exc).__name__}: {exc}"

    def failure(self) -> str | None:
        """Why the worker thread ended with an error (None: it did not, or runs)."""
        return self.error


class RayLauncher:
    """Trainer side of ``launcher: ray``: the connection, the placement group and one actor per remote worker.

    Built by the pool before it opens anything (the cluster is reached and the bundles are reserved first), the
    actors started by :meth:`start` once the rendezvous store listens; :meth:`check` answers the pool's liveness
    question per worker; :meth:`close` kills the actors (no restart), removes the placement group and disconnects.
    """

    def __init__(self, cfg: Any, indices: Iterable[int], rejoinable: bool) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from mrl_plugins.device import get_device

        rc = cfg.rollout
        self.cfg, self.indices = cfg, list(indices)
        self.rejoinable = rejoinable
        self.max_restarts = rc.restart_workers if rejoinable else 0
        self.device_type = get_device(cfg.device).type  # the trainer's device, set by enable() ('auto' before)
        self.bundles = [bundle(rc.engine_threads, self.device_type, rc.ray_resources) for _ in self.indices]
        self.actors: dict[int, Any] = {}
        self.nodes: dict[int, str] = {}  # worker -> the address of its bundle's node
        self.pg: Any = None
        self._closed = False
        self._probed: dict[int, tuple[float, dict | None]] = {}
        self._restarts_seen = dict.fromkeys(self.indices, 0)
        self._starting: dict[int, float] = {}
        self._owns_ray = connect(rc.ray_address)
        try:
            nodes = ray.nodes()
            why = placement_problem(self.bundles, rc.ray_strategy, nodes)
            if why is not None:
                raise ConfigError(
                    f"Ray (rollout.ray_address): {len(self.bundles)} worker bundle(s) {_fmt(self.bundles[0])} "
                    f"cannot be placed ({rc.ray_strategy}): {why}. Cluster: {describe_nodes(nodes)}. Add "
                    "nodes (`ray start --address HEAD:6379 --num-cpus N`), lower rollout.remote_workers or "
                    "engine_threads"
                )
            self.pg = placement_group(self.bundles, strategy=rc.ray_strategy, name=f"mrl-rollout-{os.getpid()}")
            ready, _ = ray.wait([self.pg.ready()], timeout=rc.start_timeout_s)
            if not ready:
                remove_placement_group(self.pg)
                self.pg = None
                raise StageTimeoutError(
                    f"Ray (rollout.ray_address): the cluster did not free {len(self.bundles)} bundle(s) "
                    f"{_fmt(self.bundles[0])} ({rc.ray_strategy}) within the start bound "
                    f"({rc.start_timeout_s:.0f} s: 1.5 x timeout_s); other jobs hold them. Available now: "
                    f"{_fmt(ray.available_resources())}"
                )
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start
    def start(self, address: str) -> None:
        """One actor per worker, on its bundle, running ``mrl worker --connect address --index i``."""
        import ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rc = self.cfg.rollout
        by_id = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
        on = placement_group_table(self.pg)["bundles_to_node_id"]
        self.nodes = {i: by_id.get(on.get(k, ""), "?") for k, i in enumerate(self.indices)}
        here = ray.get_runtime_context().get_node_id()
        away = sorted({self.nodes[i] for k, i in enumerate(self.indices) if on.get(k) != here})
        host = address.rpartition(":")[0]
        if away and loopback(host):
            raise ConfigError(
                f"rollout.rendezvous is {address!r}, which workers Ray placed on other nodes ({', '.join(away)}) "
                f"cannot reach: set rollout.rendezvous and comm.host to this node's address they reach (Ray knows "
                f"this node as {ray.util.get_node_ip_address()})"
            )
        cores = actor_cores(rc.ray_worker_cores, rc.engine_threads, [on.get(k, "") for k in range(len(self.indices))])
        device = "cpu" if self.device_type == "cpu" else f"{self.device_type}:0"  # Ray sets the visible devices
        threads = str(rc.engine_threads)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        actor_cls = ray.remote(RolloutActor)
        for k, i in enumerate(self.indices):
            options: dict[str, Any] = {
                "num_cpus": rc.engine_threads,
                "max_restarts": self.max_restarts,
                "max_task_retries": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=k),
                "runtime_env": {"env_vars": env},
            }
            if self.device_type == "cuda":
                options["num_gpus"] = 1
            custom = {key: v for key, v in self.bundles[k].items() if key not in ("CPU", "GPU")}
            if custom:
                options["resources"] = custom
            args = (address, i, device, rc.engine_threads, rc.start_timeout_s, cores[k])
            self.actors[i] = actor_cls.options(**options).remote(*args)
            self._starting[i] = time.monotonic()
            log.info(
                "rollout worker %d: Ray actor %s on node %s (bundle %d %s, %s, max_restarts %d)", i,
                self.actors[i]._actor_id.hex()[:12], self.nodes[i], k, _fmt(self.bundles[k]), rc.ray_strategy,
                self.max_restarts,
            )  # fmt: skip

    # ------------------------------------------------------------------ liveness
    def _state(self, i: int, now: float, fresh: bool = False) -> dict | None:
        """The GCS's record of worker ``i``'s actor (cached ``PROBE_EVERY_S``); None when Ray cannot be asked."""
        at, info = self._probed.get(i, (-1e9, None))
        if fresh or now - at >= PROBE_EVERY_S:
            try:
                from ray._private import state

                info = state.actors(self.actors[i]._actor_id.hex()) or None
            except Exception:  # noqa: BLE001 - the GCS unreachable: the heartbeat rule decides alone
                log.debug("rollout worker %d: Ray's actor state unavailable", i, exc_info=True)
                info = None
            self._probed[i] = (now, info)
        return info

    def rejoined(self, i: int) -> None:
        """Worker ``i`` joined (a new incarnation the pool took, or its first start came up): Ray's restarts of it
        so far are behind it."""
        info = self._state(i, time.monotonic(), fresh=True)
        if info is not None:
            self._restarts_seen[i] = int(info.get("NumRestarts", 0))
        self._starting.pop(i, None)

    def check(self, i: int, silent: float, joined: bool) -> str | None:
        """Why worker ``i`` is gone for good (the pool raises WorkerDiedError with it), or None: alive, or being
        (re)started by Ray within its time. ``silent``: seconds its heartbeat stood still; ``joined``: the
        incarnation the pool serves has connected."""
        rc = self.cfg.rollout
        now = time.monotonic()
        if joined and silent < PROBE_AFTER_S:
            if self._starting.pop(i, None) is not None:  # up (again): the restarts Ray made so far are behind it
                self.rejoined(i)
            return None
        info = self._state(i, now)
        if info is None:  # Ray cannot be asked: as a hand-started worker
            if joined and silent > rc.timeout_s:
                return f"remote rollout worker {i} stopped heartbeating {silent:.0f} s ago (Ray's actor state unknown)"
            return None
        state, restarts = str(info.get("State", "?")), int(info.get("NumRestarts", 0))
        restarting = restarts > self._restarts_seen[i]
        waiting = 0.0
        if not joined or restarting:  # counted from the start, or from when its predecessor fell silent
            waiting = now - self._starting.setdefault(i, now - silent if joined else now)
        pg_state = self._pg_state() if waiting > rc.timeout_s else "?"
        kind = judge(
            state, restarting=restarting, joined=joined, silent=silent, waiting=waiting, pg_state=pg_state,
            timeout_s=rc.timeout_s, start_timeout_s=rc.start_timeout_s,
        )  # fmt: skip
        where = f"Ray actor {self.actors[i]._actor_id.hex()[:12]} on node {self.nodes.get(i, '?')}"
        if kind == "dead":
            if not self.rejoinable:
                tail = (
                    "; not restarted: weight_sync or comm ends that are not rejoinable (e.g. broadcast's group takes "
                    "no new member); use weight_sync.transport 'directory' and comm.transport 'torch_distributed' "
                    "to let Ray restart workers"
                )
            elif self.max_restarts == 0:
                tail = "; set rollout.restart_workers > 0 to let Ray restart it"
            else:
                tail = f"; Ray restarted it {restarts} time(s) of max_restarts {self.max_restarts}"
            return f"rollout worker {i} ({where}) died: {_death_cause(info)}{tail}"
        if kind == "unplaceable":
            return (
                f"rollout worker {i} ({where}) lost its node and Ray cannot place it again: its placement group has "
                f"waited {waiting:.0f} s (timeout_s {rc.timeout_s:.0f}) for a node with "
                f"{_fmt(self.bundles[0])} ({rc.ray_strategy})"
            )
        if kind == "late":
            failure = self._failure(i)
            return (
                f"rollout worker {i} ({where}) did not join within the start bound ({rc.start_timeout_s:.0f} "
                f"s); Ray reports it {state}" + (f": {failure}" if failure else "")
            )
        if kind == "silent":
            return (
                f"remote rollout worker {i} stopped heartbeating {silent:.0f} s ago ({where}, which Ray reports "
                f"{state}: its link is cut, it hangs, or Ray has not noticed its node is gone)"
            )
        return None

    def _pg_state(self) -> str:
        try:
            from ray.util.placement_group import placement_group_table

            return str(placement_group_table(self.pg).get("state", "?"))
        except Exception:  # noqa: BLE001
            return "?"

    def _failure(self, i: int) -> str | None:
        """The actor's own record of why its worker thread ended (None: none, or it cannot answer in 5 s)."""
        try:
            import ray

            return ray.get(self.actors[i].failure.remote(), timeout=5)
        except Exception:  # noqa: BLE001
            return None

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Kill the actors (no restart), remove the placement group, disconnect if this launcher connected.
        Idempotent; never raises (it also runs at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        try:
            import ray
            from ray.util.placement_group import remove_placement_group
        except Exception:  # noqa: BLE001
            return
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                log.debug("killing a rollout actor failed", exc_info=True)
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                log.debug("removing the placement group failed", exc_info=True)
        if self._owns_ray:
            try:
                with signal_kept(signal.SIGTERM):
                    ray.shutdown()
            except Exception:  # noqa: BLE001
                log.debug("ray.shutdown failed", exc_info=True)
