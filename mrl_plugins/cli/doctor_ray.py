"""``mrl doctor --config C`` with ``rollout.ray_address`` (Ray starts the remote workers): the cluster's nodes and
resources against the config.

Three lines: ``ray cluster`` (Ray installed, the cluster at ``rollout.ray_address`` answers, its nodes with their
resources), ``ray placement`` (the config's bundles -- one per remote worker, :func:`~mrl_plugins.rollout.ray_launcher.
bundle` -- can be placed with ``rollout.ray_strategy`` on the alive nodes' total resources: fail if never) and
``ray free now`` (on what the nodes have free at this moment: warn if not, the run would wait for other jobs up to
``rollout.start_timeout_s``). The driver connection it makes is closed again; it starts no cluster
(``ray_address: local`` is judged against this host).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mrl_plugins.cli.checks import Check
from mrl_plugins.errors import ConfigError


def _free_nodes(nodes: list[dict]) -> list[dict]:
    """The alive nodes with the resources they have free now instead of their totals (None: Ray cannot say)."""
    try:
        from ray._private import state

        free = state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - a DeveloperAPI: without it there is no line
        return []
    return [{**n, "Resources": free.get(n["NodeID"], {})} for n in nodes if n.get("Alive")]


def ray_checks(data: Mapping[str, Any]) -> list[Check]:
    """The Ray lines for the config ``data`` (a mapping as read from YAML); none unless ``rollout.ray_address``
    is set (Ray starts the remote workers)."""
    rollout = data.get("rollout") or {}
    if not isinstance(rollout, Mapping) or rollout.get("ray_address") is None:
        return []
    from mrl_plugins.optional import is_ray_available

    if not is_ray_available():
        return [Check("fail", "ray cluster", "rollout.ray_address is set but Ray is not installed: pip install "
                      "'mrl-plugins[ray]' (here and on every node)")]  # fmt: skip
    from mrl_plugins.config import load_config
    from mrl_plugins.device import get_device
    from mrl_plugins.rollout.ray_launcher import _fmt, bundle, connect, describe_nodes, placement_problem

    cfg = load_config(dict(data))  # every other key validated first (a ConfigError is doctor's error)
    rc = cfg.rollout
    bundles = [bundle(rc.engine_threads, get_device(cfg.train.device).type, rc.ray_resources)] * rc.remote_workers
    what = f"{len(bundles)} bundle(s) {_fmt(bundles[0])} with {rc.ray_strategy}"
    if rc.ray_address == "local":
        here = [{"NodeID": "local", "Alive": True, "NodeManagerAddress": "this host",
                 "Resources": {"CPU": float(os.cpu_count() or 1)}}]  # fmt: skip
        why = placement_problem(bundles, rc.ray_strategy, here)
        started = f"ray_address local: a one-node cluster is started for the run ({describe_nodes(here)})"
        return [
            Check("ok", "ray cluster", started),
            Check("fail" if why else "ok", "ray placement", why or f"{what}: fit on this host"),
        ]
    import ray

    try:
        owned = connect(rc.ray_address)
    except ConfigError as exc:
        return [Check("fail", "ray cluster", str(exc))]
    try:
        nodes = ray.nodes()
        alive = [n for n in nodes if n.get("Alive")]
        found = f"{len(alive)} of {len(nodes)} node(s) alive at {rc.ray_address}: {describe_nodes(nodes)}"
        checks = [Check("ok" if alive else "fail", "ray cluster", found)]
        why = placement_problem(bundles, rc.ray_strategy, nodes)
        checks.append(Check("fail" if why else "ok", "ray placement", why or f"{what}: fit on the alive nodes"))
        free = _free_nodes(nodes)
        if not why and free:
            busy = placement_problem(bundles, rc.ray_strategy, free)
            checks.append(
                Check(
                    "warn",
                    "ray free now",
                    f"{busy}; other jobs hold the rest: the run waits for them up to "
                    f"the start bound ({rc.start_timeout_s:.0f} s: 1.5 x timeout_s)",
                )  # fmt: skip
                if busy
                else Check("ok", "ray free now", f"{what}: free now ({describe_nodes(free)})")
            )
        return checks
    finally:
        if owned:
            ray.shutdown()
