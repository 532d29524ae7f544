"""The pool's wire protocol (mrl_plugins.rollout.wire): messages survive pickling (both queue kinds pickle
them) and a batch's tags round-trip through the plain mapping a frame carries."""

from __future__ import annotations

import pickle

from mrl_plugins.rollout.wire import STOP, BatchMeta, GenerateRequest, StopRequest, WeightsNotice, WorkerEvent


def test_messages_pickle_and_keep_their_fields():
    msgs = [
        GenerateRequest(3, 1, [[1, 2], [3]], 4, "policy", 7, ("reference",)),
        WeightsNotice("policy", 9),
        WorkerEvent("switched", 2, 9, "policy"),
        STOP,
    ]
    back = [pickle.loads(pickle.dumps(m)) for m in msgs]
    assert back == msgs
    assert isinstance(back[3], StopRequest)


def test_batch_meta_round_trips_through_a_frames_mapping_with_extra_tags():
    meta = BatchMeta(seq=5, chunk=2, worker=1, model_id="policy", version=11, gen_us=1234, apply_us=56)
    plain = meta.to_meta()
    assert plain == {"seq": 5, "chunk": 2, "worker": 1, "model_id": "policy", "version": 11, "gen_us": 1234,
                     "apply_us": 56}  # fmt: skip
    assert BatchMeta.from_meta(plain) == meta
    tagged = BatchMeta.from_meta({**plain, "trace": "abc"})  # a transport's own tag is kept, not lost
    assert tagged.extra == {"trace": "abc"} and tagged.to_meta()["trace"] == "abc"
