"""Helper for tests/test_weight_sync_zero3.py, run under ``accelerate launch`` with DeepSpeed ZeRO-3 on CPU.

Every rank builds the same seeded model, ZeRO-3 partitions it, then every rank iterates
``iter_trainer_weights`` (the gathers are collectives) while only the main process publishes into a
directory transport. The main process reads the version back and compares it bit for bit with the
full weights it kept before partitioning; the result goes to ``$WS_OUT`` as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> int:
    import torch.distributed as dist
    from accelerate import Accelerator

    from mrl_plugins.weight_sync import DirectorySender, WeightSyncConfig, iter_trainer_weights
    from mrl_plugins.weight_sync.sources import is_zero3

    torch.set_num_threads(1)
    out_path, root = os.environ["WS_OUT"], os.environ["WS_DIR"]
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(300, 32), torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 300)
    )
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    inner = acc.unwrap_model(model)
    partitioned = is_zero3(inner)
    local_numel = sum(p.numel() for p in inner.parameters())  # partitioned: tiny or 0 per rank

    sender = (
        DirectorySender(
            WeightSyncConfig(transport="directory", directory=root, chunk_bytes=4096),
            model_id="policy",
            run_id="zero3",
        )
        if dist.get_rank() == 0  # accelerate on CPU with DeepSpeed calls every process the main one
        else None
    )
    bucket = 20_000
    peak = [0]

    def watched():
        for name, t in iter_trainer_weights(model, acc, bucket_bytes=bucket):
            # bytes of parameters currently gathered (full) on this rank
            peak[0] = max(peak[0], sum(p.ds_numel * p.element_size() for p in inner.parameters() if p.numel() > 0))
            yield name, t

    stream = watched()
    if sender is not None:
        report = sender.publish(1, stream)
    else:
        n = sum(1 for _ in stream)  # take part in every gather
        report = None
    acc.wait_for_everyone()
    result = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "zero3": partitioned,
        "local_numel": local_numel,
        "peak_gathered_bytes": peak[0],
        "bucket_bytes": bucket,
        "max_param_bytes": max(p.ds_numel * p.element_size() for p in inner.parameters()),
        "total_bytes": sum(p.ds_numel * p.element_size() for p in inner.parameters()),
    }
    if sender is not None:
        rx = sender.receiver_handle().attach()
        dest = {n: torch.empty_like(t) for n, t in full.items()}
        rx.fetch_into(1, dest, 30)
        result["bit_exact"] = all(torch.equal(dest[n], full[n]) for n in full)
        result["names"] = sorted(dest)
        result["shards"] = report.shards
    else:
        result["drained"] = n
    with open(f"{out_path}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    acc.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
