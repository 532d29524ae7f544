"""Trainer side of the two-host fault tests: a real WorkerPool with one remote worker, driven by JSON lines.

``python tests/scripts/netns_pool.py CONFIG_JSON`` (run inside the trainer's namespace) builds the pool on the
tiny model, prints ``{"ready": ADDRESS}``, then answers one JSON line per command read from stdin:

* ``{"op": "publish", "v": V}``: perturb the weights (so that every version generates differently) and publish;
* ``{"op": "collect", "v": V, "timeout": T}``: submit prompts needing version >= V and collect; the answer has
  ``version`` and ``max_err``, the largest difference between the worker's sampling logprobs and the
  trainer's own teacher-forced logprobs under the weights of the version the worker reports (wrong weights or
  a damaged batch would show here);
* ``{"op": "close"}``: close the pool (2 s grace) and exit.

Every answer carries ``s`` (seconds the command took) and, on failure, ``error`` (``Type: message``).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def main() -> int:
    import torch

    from mrl_plugins.rollout.engine import TransformersEngine
    from tests.pool_helpers import make_pool

    torch.set_num_threads(1)
    pool, model, tok, sampling, *_ = make_pool(json.loads(sys.argv[1]), placements=[])
    snapshots: dict[int, dict] = {}
    print(json.dumps({"ready": pool.workers.remote.address}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        t0 = time.monotonic()
        out: dict = {"op": cmd["op"]}
        try:
            if cmd["op"] == "publish":
                with torch.no_grad():
                    g = torch.Generator().manual_seed(cmd["v"])
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.02)
                snapshots[cmd["v"]] = {n: p.detach().clone() for n, p in model.named_parameters()}
                pool.publish(cmd["v"], list(model.named_parameters()))
            elif cmd["op"] == "collect":
                res = pool.collect(pool.submit(PROMPTS, 2, min_version=cmd["v"]), timeout=cmd.get("timeout"))
                current = {n: p.detach().clone() for n, p in model.named_parameters()}
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(snapshots[res.weight_version][n])
                    ref = TransformersEngine(model, tok, params=sampling).score(res.prompt_ids, res.completion_ids)
                    for n, p in model.named_parameters():
                        p.copy_(current[n])
                errs = [abs(a - b) for x, y in zip(res.logprobs, ref) for a, b in zip(x, y)]
                out.update(version=res.weight_version, max_err=max(errs), n=len(res.completion_ids))
            elif cmd["op"] == "close":
                pool.close(timeout=2)
                out.update(ok=True, s=time.monotonic() - t0)
                print(json.dumps(out), flush=True)
                return 0
            out["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        out["s"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
    pool.close(timeout=2)
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # as `mrl worker` does: no interpreter teardown while gloo threads run
