"""Both ends of the corruption cases of tests/test_netns_corrupt.py, one per network namespace.

``python tests/scripts/netns_corrupt.py ROLE ARGS_JSON`` prints JSON lines:

* ``frames-consumer`` (trainer): a torch_distributed consumer; prints ``{"port"}``, then receives until the
  producer closed, counting the frames refused (FrameError) and checking every accepted one against the batch
  its ``seq`` names.
* ``frames-producer`` (worker): sends 9 batches; every third frame gets one payload byte flipped after it was
  encoded and checksummed (what a link that slipped past TCP's checksum would deliver).
* ``weights-sender`` (trainer): a broadcast sender publishing versions 1, 2 and 3; prints ``{"handle"}``.
* ``weights-receiver`` (worker): tests/test_weight_sync_broadcast.py's corrupting receiver (version 2 arrives
  with one byte flipped): its report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

N_FRAMES = 9


def frames_consumer(args: dict) -> dict:
    import torch

    from mrl_plugins.comm.base import ChannelClosedError
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.comm.dist_transport import DistConsumer
    from mrl_plugins.comm.frame import FrameError
    from tests.test_comm_dist import _batch

    cfg = CommConfig(transport="torch_distributed", host=args["host"], heartbeat_timeout_s=30.0)
    cons = DistConsumer(cfg, n_producers=1, run_id="corrupt", host=args["host"])
    print(json.dumps({"port": cons.port}), flush=True)
    good, refused, wrong = [], [], []
    try:
        while True:
            try:
                r = cons.receive(timeout=60)
            except FrameError as exc:
                refused.append(str(exc))
                continue
            except ChannelClosedError:
                break
            want = _batch(r.meta["seq"])
            if not torch.equal(r.batch["completion_ids"], want["completion_ids"]):
                wrong.append(r.meta["seq"])
            good.append(r.meta["seq"])
            r.release()
        return {"good": good, "refused": refused, "wrong": wrong, "corrupt": cons.stats()["corrupt"]}
    finally:
        cons.close()


def frames_producer(args: dict) -> dict:
    import mrl_plugins.comm.dist_transport as dt
    from mrl_plugins.comm.config import CommConfig
    from tests.test_comm_dist import _batch

    class Flipped(dt.FramePlan):
        def write_into(self, buf):  # type: ignore[no-untyped-def]
            n = super().write_into(buf)
            if self._seq % 3 == 1:
                view = memoryview(buf).cast("B")
                view[len(view) // 2] ^= 0x10
            return n

        def __init__(self, batch, meta, *a, **kw):  # type: ignore[no-untyped-def]
            super().__init__(batch, meta, *a, **kw)
            self._seq = int(meta["seq"])

    dt.FramePlan = Flipped
    cfg = CommConfig(transport="torch_distributed", host=args["host"], heartbeat_timeout_s=30.0)
    prod = dt.DistProducerHandle(args["host"], args["port"], 0, 1, "corrupt", cfg.to_dict()).attach(timeout=60)
    for seq in range(N_FRAMES):
        prod.send(_batch(seq), {"seq": seq, "version": 1}, timeout=60)
    prod.close()
    return {"sent": N_FRAMES}


def weights_sender(args: dict) -> dict:
    from mrl_plugins.weight_sync import BroadcastSender, WeightSyncConfig
    from tests.test_weight_sync_broadcast import filled, model_for_test

    cfg = WeightSyncConfig(transport="broadcast", timeout_s=60, bucket_bytes=20_000, chunk_bytes=4096).validate()
    sender = BroadcastSender(cfg, model_id="policy", group_bytes=60_000, host=args["host"])
    print(json.dumps({"handle": dataclasses.asdict(sender.receiver_handle())}), flush=True)
    model = model_for_test()
    shards = [sender.publish(v, filled(model, float(v))).shards for v in (1, 2, 3)]
    return {"shards": shards}


def weights_receiver(args: dict) -> dict:
    from mrl_plugins.weight_sync.broadcast import BroadcastHandle
    from tests.test_weight_sync_broadcast import _corrupting_receiver

    got: list = []

    class Report:
        def put(self, item):  # type: ignore[no-untyped-def]
            got.append(item)

    _corrupting_receiver(BroadcastHandle(**args["handle"]), Report())
    return {"report": list(got[0])}


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    role = {"frames-consumer": frames_consumer, "frames-producer": frames_producer,
            "weights-sender": weights_sender, "weights-receiver": weights_receiver}[sys.argv[1]]  # fmt: skip
    print(json.dumps(role(json.loads(sys.argv[2]))), flush=True)
    os._exit(0)  # no interpreter teardown while gloo's threads run
