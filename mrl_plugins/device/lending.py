"""Lending a colocated rollout worker's share of the trainer's accelerator to the trainer while the worker is idle
(``rollout.lend_cores`` with ``rollout.placement: auto``; the CPU side, core affinity and torch threads, is done by
:class:`~mrl_plugins.rollout.arrangement.TrainerShare` itself).

* **NPU** (torch_npu ``set_stream_limit`` / ``reset_stream_limit`` / ``get_stream_limit``, Ascend Extension for
  PyTorch 7.2.0+): in the split the training stream (the trainer's current stream) is limited to the device's
  cube/vector cores minus the colocated workers' ``rollout.engine_budget`` shares, so the two sides do not contend;
  while the workers are idle the limit is reset (the whole device), and set again before the next generation
  request. torch_npu documents that the last setting on a stream wins and that a set stream may be used from any
  thread; only Ascend C operators honour the limit. **Unverified on hardware here** (tested against a fake
  torch_npu that records the calls).
* **CUDA**: nothing to lend. torch has no per-stream SM share (``torch.cuda.Stream`` takes a priority only; MPS
  active-thread percentages are per process and fixed at its start), so the trainer already uses every SM the
  worker leaves idle.
* **CPU**: not here (affinity and threads, see above).

torch_npu is imported inside the calls, never at module import.
"""

from __future__ import annotations

from typing import Any

from mrl_plugins.device.budget import npu_limit_args
from mrl_plugins.device.probe import CORE_LIMIT_RELEASES

#: why CUDA lends nothing (logged once per run and in the docs)
CUDA_NOTHING_TO_LEND = (
    "CUDA has no per-stream SM share in torch (a stream takes a priority only), so the trainer already uses the SMs "
    "an idle worker leaves: nothing to lend"
)


def split_share(full: tuple[int, int], worker: tuple[int, int], colocated: int) -> tuple[tuple[int, int] | None, str]:
    """The training stream's (cube, vector) limit in the split: the device's ``full`` cores minus ``colocated``
    workers' ``worker`` share each (-1 in ``worker``: that kind is not limited for the workers, and not for the
    trainer either). ``(None, why)`` when there is nothing to lend or no core would be left to the trainer."""
    if colocated < 1:
        return None, "no rollout worker shares the trainer's NPU"
    if all(w == -1 for w in worker):
        return None, "rollout.engine_budget sets no npu_cube_cores/npu_vector_cores: the worker's share is not limited"
    share = []
    for kind, total, each in zip(("cube", "vector"), full, worker, strict=True):
        if each == -1:
            share.append(-1)
            continue
        left = total - colocated * each
        if left < 1:
            return None, (
                f"{colocated} worker(s) x {each} {kind} cores leave none of the NPU's {total} to the trainer"
            )
        share.append(left)
    return (share[0], share[1]), ""


class NpuStreamLender:
    """The training stream's core limit: :meth:`split` (its own share while the workers compute), :meth:`lend`
    (the whole device while they are idle), :meth:`close` (back to torch_npu's default). Calls only on a change."""

    def __init__(self, npu: Any, stream: Any, share: tuple[int, int], full: tuple[int, int]) -> None:
        self.npu, self.stream, self.share, self.full = npu, stream, share, full
        self.state: str | None = None  # "split" | "lent" | None (default limit)

    def describe(self) -> str:
        return (
            f"training stream {self.share[0]} cube / {self.share[1]} vector cores in the split, "
            f"all {self.full[0]} / {self.full[1]} while the workers are idle"
        )

    def split(self) -> None:
        if self.state != "split":
            self.npu.set_stream_limit(self.stream, self.share[0], self.share[1])
            self.state = "split"

    def lend(self) -> None:
        if self.state != "lent":
            self._default()
            self.state = "lent"

    def close(self) -> None:
        if self.state is not None:
            self._default()
            self.state = None

    def _default(self) -> None:
        if hasattr(self.npu, "reset_stream_limit"):
            self.npu.reset_stream_limit(self.stream)
        else:
            self.npu.set_stream_limit(self.stream, self.full[0], self.full[1])


def open_lender(device: Any, engine_budget: dict, colocated: int) -> tuple[NpuStreamLender | None, str]:
    """The lender for a trainer on ``device`` with ``colocated`` workers of ``engine_budget`` beside it, or
    ``(None, why not)``: not an NPU (CUDA: :data:`CUDA_NOTHING_TO_LEND`), torch_npu without the stream-limit API,
    no worker share to lend."""
    kind = getattr(device, "type", "cpu")
    if kind == "cuda":
        return None, CUDA_NOTHING_TO_LEND
    if kind != "npu":
        return None, f"{kind}: lending is the runtime's core affinity, not a device limit"
    budget = dict(engine_budget or {})
    share_wanted = npu_limit_args(budget.get("npu_cube_cores"), budget.get("npu_vector_cores"))
    if colocated < 1 or all(w == -1 for w in share_wanted):
        return None, split_share((0, 0), share_wanted, colocated)[1]
    from mrl_plugins.device.npu import npu_namespace

    npu = npu_namespace()
    if not hasattr(npu, "set_stream_limit"):
        return None, f"torch_npu has no set_stream_limit (needs {CORE_LIMIT_RELEASES}): nothing lent"
    index = 0 if device.index is None else device.index
    stream = npu.current_stream(index)
    if hasattr(npu, "get_stream_limit"):
        got = npu.get_stream_limit(stream)
    elif hasattr(npu, "get_device_limit"):
        got = npu.get_device_limit(index)
    else:
        return None, "torch_npu reports no core counts (get_stream_limit/get_device_limit): nothing lent"
    full = (int(got["cube_core_num"]), int(got["vector_core_num"]))
    share, why = split_share(full, share_wanted, colocated)
    if share is None:
        return None, why
    return NpuStreamLender(npu, stream, share, full), ""
