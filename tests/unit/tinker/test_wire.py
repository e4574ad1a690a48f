"""Tinker data <-> lorarl data, through the SDK's own encoders and decoders (tinker.proto): a datum becomes a
one-token prompt and the N targets; what lorarl cannot train is refused by name; outputs decode in the SDK."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from lorarl.tinker import wire
from lorarl.tinker.futures import UserError
from lorarl.v1 import common_pb2, rollout_pb2


def request(data: list[types.Datum], loss: str = "importance_sampling", config: dict | None = None):
    return forward_backward_request_to_proto(ForwardBackwardRequest(
        model_id="m", seq_id=1, forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss,
                                                                           loss_fn_config=config)))


def datum(tokens: list[int], **inputs) -> types.Datum:
    inputs.setdefault("target_tokens", [*tokens[1:], 99])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={
        k: types.TensorData.from_numpy(np.asarray(v, dtype=np.int64 if k == "target_tokens" else np.float32))
        for k, v in inputs.items()})


def test_a_datum_is_a_one_token_prompt_and_its_targets() -> None:
    (t,) = wire.trajectories(request([datum([5, 6, 7], logprobs=[0.0, -1.0, -2.0], advantages=[0.0, 1.0, 2.0])]),
                             "job")
    assert (list(t.prompt_token_ids), list(t.completion_token_ids)) == ([5], [6, 7, 99])
    assert list(t.behavior_logprobs) == [0.0, -1.0, -2.0] and list(t.token_advantages) == [0.0, 1.0, 2.0]
    (ce,) = wire.trajectories(request([datum([5, 6])], "cross_entropy"), "job")
    assert list(ce.token_advantages) == [1.0, 1.0]  # no weights: each 1


@pytest.mark.parametrize(("data", "loss", "message"), [
    ([datum([5, 6, 7], target_tokens=[6, 8, 9], logprobs=[0.0] * 3, advantages=[0.0] * 3)], "importance_sampling",
     r"target_tokens\[1\] is not model_input\[2\]"),
    ([datum([5, 6], logprobs=[0.0, 0.0])], "importance_sampling", "advantages is missing"),
    ([datum([5, 6], weights=[1.0, 1.0], clip_low_threshold=[0.5, 0.5])], "cross_entropy",
     r"\['clip_low_threshold'\] not read by loss cross_entropy"),
    ([datum([5, 6], weights=[1.0, math.nan])], "cross_entropy", r"weights\[1\] is nan"),
    ([datum([5, 6], weights=[1.0])], "cross_entropy", r"shape \[1\], expected \[2\]"),
    ([datum([5, 6])], "stable_reinforce", "loss_fn 'stable_reinforce' is not served"),
    ([datum([5, 6])], "dro", "loss_fn 'dro' is not served"),
    ([], "cross_entropy", "at least one datum"),
])
def test_what_cannot_be_trained_is_refused_by_name(data, loss, message) -> None:
    with pytest.raises(UserError, match=message):
        wire.trajectories(request(data, loss), "job")


def test_ppo_and_cispo_thresholds_become_clip_ranges_and_other_config_is_refused() -> None:
    ppo = request([datum([5, 6])], "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    assert wire.loss_config(ppo) == pytest.approx({"clip_eps_low": 0.3, "clip_eps_high": 0.3})
    cispo = request([datum([5, 6])], "cispo", {"clip_high_threshold": 1.28})
    assert wire.loss_config(cispo) == pytest.approx({"clip_eps_low": 0.2, "clip_eps_high": 0.28})
    (trajectory,) = wire.trajectories(request([datum([5, 6], logprobs=[-1.0, -2.0], advantages=[1.0, -1.0])],
                                              "cispo"), "job")
    assert list(trajectory.token_advantages) == [1.0, -1.0] and wire.LOSSES["cispo"] == "token_cispo"
    with pytest.raises(UserError, match=r"\['beta'\] not read by loss importance_sampling"):
        wire.loss_config(request([datum([5, 6])], "importance_sampling", {"beta": 0.1}))


def test_outputs_decode_in_the_sdk() -> None:
    decoded = deserialize_forward_backward_output(wire.forward_backward_output(
        [[-1.0, -2.0], [-0.5]], {"loss": 3.5, "tokens": 3.0, "clip_fraction": 0.25}))
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert decoded.metrics == {"loss:sum": 3.5, "tokens:sum": 3.0, "clip_fraction:mean": 0.25}
    completions = [rollout_pb2.Completion(token_ids=[4, 5], logprobs=[-0.1, -0.2],
                                          finish_reason=common_pb2.FINISH_REASON_LENGTH),
                   rollout_pb2.Completion(token_ids=[6], logprobs=[-0.3], finish_reason=common_pb2.FINISH_REASON_STOP)]
    sample = deserialize_sample_response(wire.sample_response(completions, [math.nan, -1.5, -2.5]))
    assert [s.tokens for s in sample.sequences] == [[4, 5], [6]]
    assert [s.stop_reason for s in sample.sequences] == ["length", "stop"]
    assert sample.sequences[1].logprobs == pytest.approx([-0.3])
    assert sample.prompt_logprobs[0] is None and sample.prompt_logprobs[1:] == pytest.approx([-1.5, -2.5])


def test_top_logprobs_decode_in_the_sdk_best_first_with_its_sentinel() -> None:
    """Per position the k best (token, logprob) best first; fewer than k padded, an unscored one None."""
    tops = [None, rollout_pb2.TopLogprobs(token_ids=[7, 3], logprobs=[-2.0, -0.5]),
            rollout_pb2.TopLogprobs(token_ids=[9], logprobs=[-0.1])]
    completions = [rollout_pb2.Completion(token_ids=[3], logprobs=[-0.5], top_logprobs=[tops[1]],
                                          finish_reason=common_pb2.FINISH_REASON_STOP)]
    sample = deserialize_sample_response(wire.sample_response(completions, [math.nan, -0.5, -0.1], tops, 2, 1))
    assert sample.topk_prompt_logprobs == [None, [(3, -0.5), (7, -2.0)], [(9, pytest.approx(-0.1))]]
    assert sample.sequences[0].topk_logprobs == [[(3, -0.5)]]
    plain = deserialize_sample_response(wire.sample_response(completions, [math.nan, -0.5, -0.1]))
    assert plain.topk_prompt_logprobs is None and plain.sequences[0].topk_logprobs is None
