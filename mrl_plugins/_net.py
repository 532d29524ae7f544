"""Which local address a gloo group binds to, shared by the torch.distributed experience and weight transports.

gloo's default device binds to the address this host's *name* resolves to, which on many machines (and in
network namespaces) is ``127.0.0.1``: the peers on other hosts would then be told to connect to their own
loopback. Instead every rank binds to its address on the route towards the group's store: the trainer
(which owns the store) to the store's address, a worker on another host to its address facing the trainer.
``GLOO_SOCKET_IFNAME`` still wins when it is set.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any


def local_address(peer: str) -> str:
    """This host's address on the route to ``peer`` (a UDP ``connect``: no packet is sent)."""
    if peer in ("localhost", "127.0.0.1") or peer.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
        except OSError as exc:
            raise OSError(f"no route from this host to {peer!r} ({exc})") from None
        return str(s.getsockname()[0])


def gloo_devices(peer: str, count: int = 1) -> list[Any]:
    """``count`` gloo devices bound to :func:`local_address` towards ``peer`` (or ``GLOO_SOCKET_IFNAME``)."""
    import torch.distributed as dist

    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return [dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0]) for _ in range(count)]
    addr = local_address(peer)
    return [dist.ProcessGroupGloo.create_device(hostname=addr) for _ in range(count)]


def td(seconds: float) -> datetime.timedelta:
    """``seconds`` as the ``timedelta`` torch.distributed takes."""
    return datetime.timedelta(seconds=float(seconds))


def gloo_group(store: Any, rank: int, world: int, timeout: float, host: str, connections: int = 1) -> Any:
    """A ``ProcessGroupGloo`` on ``store``: a ``timeout``-second timeout, ``connections`` :func:`gloo_devices`."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = td(timeout)
    opts._devices = gloo_devices(host, connections)
    return dist.ProcessGroupGloo(store, rank, world, opts)


def gloo_broadcast(pg: Any, t: Any, timeout: float) -> Any:
    """Start broadcasting ``t`` from rank 0 of the gloo group ``pg`` (a ``timeout``-second timeout); its work."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.timeout = 0, td(timeout)
    return pg.broadcast([t], opts)


__all__ = ["gloo_broadcast", "gloo_devices", "gloo_group", "local_address", "td"]
