"""Run under ``accelerate launch --multi_gpu --num_processes 2`` on CPU (gloo): tiny GRPO with the plugins on
every rank. Writes ``<out>/rank<r>.json`` with the rank's log history, worker pids and last published version.

argv: output folder, the rollout section as JSON, the mode (``colocate`` or ``disaggregated``), optionally the
trainer (``grpo``, the default, or ``rloo``).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    out_dir, rollout, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    kind = sys.argv[4] if len(sys.argv) > 4 else "grpo"
    import torch

    torch.set_num_threads(1)
    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    cfg = load_config({"train": {"model": "tiny", "trainer": kind, "steps": 4, "output_dir": out_dir}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=out_dir)
    mrl_plugins.enable(trainer, {"mode": mode, "rollout": rollout})
    pool = getattr(trainer._mrl_state.runtime, "pool", None)
    trainer.train()  # shuts the plugins down at its end
    result = {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "hist": [h for h in trainer.state.log_history if "loss" in h],
        "pids": pool.pids if pool is not None else [],
        "cores": [sorted(p["cores"]) for p in (s.__dict__ for s in pool.workers.specs)] if pool is not None else [],
        "version": trainer.vllm_generation.version,
    }
    with open(f"{out_dir}/rank{result['rank']}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():  # a clean end: left to interpreter exit, rank 0 once aborted in c10d
        torch.distributed.destroy_process_group()  # ("terminate called without an active exception", exit -6)


if __name__ == "__main__":
    main()
