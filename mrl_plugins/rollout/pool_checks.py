"""What a worker pool refuses before anything starts, decided by the comm and weight-sync plugins' capabilities
(the adapter asks at ``enable()``, the pool again when it opens its ends)."""

from __future__ import annotations

from typing import Any

from mrl_plugins.errors import MrlError
from mrl_plugins.hookspecs import StageContext


class WorkerDiedError(MrlError):
    """A rollout worker process exited or stopped answering (also ``mrl_plugins.rollout.pool.WorkerDiedError``)."""


def no_rejoin(what: str) -> str:
    """Why an end that is not ``rejoinable`` cannot take a restarted worker (one wording for every refusal)."""
    return (
        f"{what} keeps the group formed at its first transfer, which a new process cannot rejoin (its ends are not "
        "rejoinable); use weight_sync.transport 'shm' or 'directory' and comm.transport 'shm' or 'queue'"
    )


def stage_names(pm: Any, cfg: Any) -> tuple[str, str]:
    """How the comm and weight-sync ends are named in errors: the plugin and, for ``mrl``, its transport."""
    from mrl_plugins.upstream import UPSTREAM_COMM_TRANSPORT, UPSTREAM_WEIGHT_TRANSPORT

    def name(stage: str, transport: str, upstream: str) -> str:
        plugin = pm.selected.get(stage, "")
        if plugin == "upstream":
            return f"the 'upstream' {stage} ({upstream})"
        if plugin == "mrl":
            return f"{stage}.transport {transport!r}"
        return f"plugins.{stage} {plugin!r}"

    return (
        name("comm", cfg.comm.transport, UPSTREAM_COMM_TRANSPORT),
        name("weight_sync", cfg.weight_sync.transport, UPSTREAM_WEIGHT_TRANSPORT),
    )


def loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (other hosts cannot reach it)."""
    return host in ("localhost", "") or host.startswith("127.")


def check_pool_config(pm: Any, cfg: Any, n_local: int) -> tuple[Any, Any]:
    """What a pool of ``n_local`` local workers (plus ``rollout.remote_workers``) refuses under ``cfg``, decided by
    the selected comm and weight-sync plugins' capabilities and checked before anything is started (the adapter
    asks at ``enable()``); returns those capabilities ``(comm, weight_sync)``."""
    from mrl_plugins.errors import ConfigError

    remote = cfg.rollout.remote_workers
    if n_local + remote < 1:
        raise ConfigError("rollout.workers: a worker pool needs at least one worker (local or remote)")
    ctx = StageContext(config=cfg, plugins=pm)
    comm, ws = pm.capabilities("comm", ctx), pm.capabilities("weight_sync", ctx)
    comm_name, ws_name = stage_names(pm, cfg)
    if remote and not (comm.cross_host and ws.cross_host):
        raise ConfigError(
            f"rollout.remote_workers: workers on other hosts need comm and weight-sync ends that reach other hosts "
            f"(cross_host: comm.transport 'torch_distributed', weight_sync.transport 'broadcast', 'per_param' or "
            f"'directory'); {comm_name} "
            f"{'does' if comm.cross_host else 'does not'}, {ws_name} {'does' if ws.cross_host else 'does not'}"
        )
    host = cfg.rollout.rendezvous.rpartition(":")[0]
    if remote and not loopback(host) and loopback(cfg.comm.host):
        raise ConfigError(
            f"comm.host is {cfg.comm.host!r}, which workers on other hosts cannot reach: set it to this host's "
            f"address they reach (e.g. the rollout.rendezvous host, {host!r})"
        )
    if cfg.rollout.rebalance and not (ws.rejoinable and comm.rejoinable):
        what = ws_name if not ws.rejoinable else comm_name
        raise ConfigError(f"rollout.rebalance moves (restarts) workers: {no_rejoin(what)}, or rebalance: false")
    return comm, ws
