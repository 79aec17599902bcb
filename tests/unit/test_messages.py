"""The wire codec (actors/protocol/messages.py): every message comes back equal to what
was sent, an Outputs frame keeps every field of every output, a frame of another wire
version or a message foreign to the channel is refused."""
from __future__ import annotations

import numpy as np
import pytest

from actors.protocol.messages import (CORE_RECEIVES_FROM_FRONT, CORE_RECEIVES_FROM_RANK,
                                      FRONT_RECEIVES, HEADER, MAX_FRAME, RANK_RECEIVES,
                                      WIRE_VERSION, AddRequest, FinishRequest, GrammarVocab,
                                      Outputs, RanksFailed, Ready, Rejected, RequestOutput, Stats,
                                      StatsQuery, StatsReply, StepFailed, WireError, body_length,
                                      decode, encode)
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.step_plan import StepOutput, StepPlan


def _round_trip(message, accepted):
    frame = encode(message)
    assert body_length(frame[:HEADER.size]) == len(frame) - HEADER.size
    return decode(frame[HEADER.size:], accepted)


def test_front_channel_messages_round_trip():
    params = SamplingParams(max_tokens=9, temperature=0.5, seed=3, stop=["x"], logit_bias={5: -1.0})
    for message in (AddRequest("r1", [1, 2, 3], params, None), AddRequest("r2", [4], SamplingParams(), 1),
                    FinishRequest("r1", "stop"), GrammarVocab(None), GrammarVocab("{}"),
                    StatsQuery(7, Stats.RANKS)):
        assert _round_trip(message, CORE_RECEIVES_FROM_FRONT) == message
    for message in (Ready(), StatsReply(7, [{"rank": 0}]), Rejected("r1", "empty"),
                    RanksFailed(None, "gone"), RanksFailed(1, "gone")):
        assert _round_trip(message, FRONT_RECEIVES) == message


def test_outputs_keep_every_field():
    outs = [RequestOutput("a", [1, 2], "", False, None, 5, 2, [2], 3, [(-0.1, [1], [-0.1])], [None, (-1.0, [], [], 1)]),
            RequestOutput("b", [], "", True, "abort", 7, 0),
            RequestOutput("c", [9], "", True, "stop", 1, 4, cached_tokens=1)]
    back = _round_trip(Outputs(outs), FRONT_RECEIVES)
    assert isinstance(back, Outputs) and back.outputs == outs
    assert _round_trip(Outputs([]), FRONT_RECEIVES) == Outputs([])


def test_step_channel_messages_round_trip():
    plan = StepPlan(4, "decode", [1, 2], temperature=[0.0, 1.0], coins=np.ones((2, 1), dtype=np.float32))
    back = _round_trip(plan, RANK_RECEIVES)
    assert back.rows == plan.rows and np.array_equal(back.coins, plan.coins)
    out = StepOutput(4, [[7], [8, 9]], {"decode": 0.1}, eager="batch_size", draft_shape=1)
    assert _round_trip(out, CORE_RECEIVES_FROM_RANK) == out
    assert _round_trip(StepFailed("bad", "trace"), CORE_RECEIVES_FROM_RANK) == StepFailed("bad", "trace")


def test_a_message_foreign_to_the_channel_is_refused():
    frame = encode(FinishRequest("r1", "stop"))
    with pytest.raises(WireError, match="FinishRequest"):
        decode(frame[HEADER.size:], RANK_RECEIVES)
    frame = encode(StepPlan(1, "decode", [1]))
    with pytest.raises(WireError, match="StepPlan"):
        decode(frame[HEADER.size:], FRONT_RECEIVES)


def test_another_wire_version_or_a_garbage_length_is_refused():
    with pytest.raises(WireError, match="wire version"):
        body_length(HEADER.pack(WIRE_VERSION + 1, 10))
    with pytest.raises(WireError, match="bytes"):
        body_length(HEADER.pack(WIRE_VERSION, MAX_FRAME + 1))
