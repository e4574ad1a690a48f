"""Tinker data <-> lorarl data: datums to trajectories, logprobs to ForwardBackwardOutput, completions to a
SampleResponse (the SDK's `tinker_public` protobuf, docs/tinker_protocol.md section 5).

A Tinker datum is next-token prediction over one sequence: ``model_input[i]`` predicts ``target_tokens[i]``,
with one weight (cross_entropy) or advantage and sampler logprob per position. As a lorarl trajectory that is
a one-token prompt (``model_input[0]``) and a completion of the N targets, so every position is trained and
its logprob comes back; targets that are not the shifted input (another sequence) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from lorarl.tinker.futures import UserError
from lorarl.v1 import common_pb2

#: Tinker loss name -> lorarl loss type (lorarl.contract.training.TOKEN_LOSSES).
LOSSES = {"cross_entropy": "cross_entropy", "importance_sampling": "importance_sampling", "ppo": "token_ppo",
          "cispo": "token_cispo"}
#: The loss_fn_inputs each loss reads, beside target_tokens; anything else sent is refused, not ignored.
INPUTS = {"cross_entropy": {"weights"}, "importance_sampling": {"logprobs", "advantages"},
          "ppo": {"logprobs", "advantages"}, "cispo": {"logprobs", "advantages"}}
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def tokens_of(chunks: Sequence[pb.Chunk], where: str) -> list[int]:
    out: list[int] = []
    for i, chunk in enumerate(chunks):
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise UserError(f"{where}.model_input[{i}]: only text (encoded_text) chunks are served, not "
                            f"{chunk.WhichOneof('chunk')}")
        out.extend(int(t) for t in np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
    return out


def dense(tensor: pb.Tensor, name: str, length: int) -> np.ndarray:
    """A 1-D dense tensor of ``length`` entries (a sparse or 2-D one is refused, naming it)."""
    if tensor.WhichOneof("encoding") != "dense" or tensor.dtype not in _NUMPY:
        raise UserError(f"{name}: a dense float32/int64 tensor is needed")
    values = np.frombuffer(tensor.dense, dtype=_NUMPY[tensor.dtype])
    if len(tensor.shape) > 1 or values.size != length:
        raise UserError(f"{name}: shape {list(tensor.shape) or [values.size]}, expected [{length}] (one per "
                        "model_input token)")
    return values


def floats(inputs: dict, name: str, where: str, loss: str, n: int, default: float | None = None) -> list[float]:
    """loss_fn_inputs[name] as N finite floats (``default`` for each when absent; None: it is required)."""
    if name not in inputs:
        if default is None:
            raise UserError(f"{where}.loss_fn_inputs.{name} is missing (loss {loss} reads it)")
        return [default] * n
    values = dense(inputs[name], f"{where}.loss_fn_inputs.{name}", n).astype(float).tolist()
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise UserError(f"{where}.loss_fn_inputs.{name}[{bad}] is {values[bad]}, not a finite number")
    return values


def trajectories(request: pb.ForwardBackwardRequest, job_id: str) -> list[common_pb2.Trajectory]:
    """The request's datums as trajectories for the lorarl loss LOSSES[loss_fn]."""
    loss = request.loss_fn
    if loss not in LOSSES:
        raise UserError(f"loss_fn {loss!r} is not served; lorarl serves {sorted(LOSSES)}")
    if not request.data:
        raise UserError("forward_backward needs at least one datum")
    out = []
    for d, datum in enumerate(request.data):
        where = f"data[{d}]"
        tokens = tokens_of(datum.model_input, where)
        n = len(tokens)
        if n == 0:
            raise UserError(f"{where}.model_input is empty")
        inputs = dict(datum.loss_fn_inputs)
        unknown = set(inputs) - INPUTS[loss] - {"target_tokens"}
        if unknown:
            raise UserError(f"{where}.loss_fn_inputs: {sorted(unknown)} not read by loss {loss} (it reads "
                            f"target_tokens and {sorted(INPUTS[loss])})")
        if "target_tokens" not in inputs:
            raise UserError(f"{where}.loss_fn_inputs.target_tokens is missing")
        targets = [int(t) for t in dense(inputs["target_tokens"], f"{where}.loss_fn_inputs.target_tokens", n)]
        if targets[:-1] != tokens[1:]:
            first = next(i for i, (a, b) in enumerate(zip(targets[:-1], tokens[1:], strict=True)) if a != b)
            raise UserError(f"{where}: target_tokens[{first}] is not model_input[{first + 1}]; lorarl trains "
                            "next-token targets of the datum's own sequence")

        if loss == "cross_entropy":
            advantages, behaviour = floats(inputs, "weights", where, loss, n, 1.0), [0.0] * n
        else:
            advantages = floats(inputs, "advantages", where, loss, n)
            behaviour = floats(inputs, "logprobs", where, loss, n)
        out.append(common_pb2.Trajectory(
            id=f"{d}", job_id=job_id, group_id=f"datum-{d}", prompt_token_ids=tokens[:1],
            completion_token_ids=tokens[1:] + targets[-1:], behavior_logprobs=[min(b, 0.0) for b in behaviour],
            token_versions=[0] * n, token_advantages=advantages, finish_reason=common_pb2.FINISH_REASON_STOP))
    return out


def loss_config(request: pb.ForwardBackwardRequest) -> dict[str, float]:
    """ppo's and cispo's clip thresholds (ratio bounds; 0.8 and 1.2 unless given) as lorarl clip ranges; other
    config keys are refused."""
    config = {k: v for k, v in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise UserError(f"loss_fn_config.{key}: a number is needed")
        config[key] = value.number
    allowed = {"clip_low_threshold", "clip_high_threshold"} if request.loss_fn in ("ppo", "cispo") else set()
    unknown = set(config) - allowed
    if unknown:
        raise UserError(f"loss_fn_config: {sorted(unknown)} not read by loss {request.loss_fn}")
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if not (0 < low <= 1 <= high <= 11):
        raise UserError(f"loss_fn_config: clip thresholds must satisfy 0 < low <= 1 <= high <= 11, got {low}, {high}")
    return {"clip_eps_low": 1.0 - low, "clip_eps_high": high - 1.0}


def forward_backward_output(logprobs: Sequence[Sequence[float]], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord with each datum's ``logprobs`` (float32) and the metrics under reduction suffixes."""
    arrays = [np.asarray(lp, dtype=np.float32) for lp in logprobs]
    offsets = np.cumsum([0, *[a.nbytes for a in arrays]]).astype(np.int64)
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(arrays), fields={"logprobs": pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)})
    values = {"loss:sum": float(metrics.get("loss", 0.0)), "tokens:sum": float(metrics.get("tokens", 0.0))}
    for key in ("clip_fraction", "ratio_mean"):
        if key in metrics:
            values[f"{key}:mean"] = float(metrics[key])
    return pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                    metrics=values).SerializeToString()


#: The SDK's "no entry" in a top-k matrix (tinker.types.topk_logprobs.MASK_LOGPROB, with token id 0).
MASK_LOGPROB = -99999.0


def topk_logprobs(tops: Sequence[Any], k: int) -> pb.TopkLogprobs:
    """Per position the k most likely (token, logprob), best first, as the SDK's [length, k] matrices; a
    position with fewer (or None: nothing there) is padded with the SDK's sentinel."""
    ids = np.zeros((len(tops), k), dtype="<i4")
    logprobs = np.full((len(tops), k), MASK_LOGPROB, dtype="<f4")
    for i, top in enumerate(tops):
        pairs = [] if top is None else sorted(zip(top.token_ids, top.logprobs, strict=True), key=lambda p: -p[1])
        for j, (token, logprob) in enumerate(pairs[:k]):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(tops))


def sample_response(completions: Sequence, prompt_logprobs: Sequence[float] | None,
                    prompt_tops: Sequence[Any] | None = None, topk_prompt: int = 0, topk_sample: int = 0) -> bytes:
    """The rollout's completions (lorarl.v1.Completion) as a SampleResponse, with per-token logprobs; with
    ``topk_sample`` each sampled token's top alternatives, with ``topk_prompt`` each prompt token's
    (``prompt_tops``: lorarl.v1.TopLogprobs per prompt token, None where not scored)."""
    length = common_pb2.FINISH_REASON_LENGTH
    sequences = [pb.SampledSequence(
        stop_reason=pb.STOP_REASON_LENGTH if c.finish_reason == length else pb.STOP_REASON_STOP,
        tokens=np.asarray(list(c.token_ids), dtype="<i4").tobytes(),
        logprobs=np.asarray(list(c.logprobs), dtype="<f4").tobytes()) for c in completions]
    if topk_sample:
        for sequence, c in zip(sequences, completions, strict=True):
            sequence.topk_sampled_logprobs.CopyFrom(topk_logprobs(list(c.top_logprobs), topk_sample))
    response = pb.SampleResponse(sequences=sequences)
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray(list(prompt_logprobs), dtype="<f4").tobytes()
    if topk_prompt and prompt_tops is not None:
        response.topk_prompt_logprobs.CopyFrom(topk_logprobs(prompt_tops, topk_prompt))
    return response.SerializeToString()
