"""The command codec between trainer ranks: every argument type round-trips exactly, malformed bytes are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.trainer.engines.api import AdamStep, LimitsSpec, MegatronSpec, OptimizerSpec, TrainingSpec, TrajectoryRecord
from lorarl.trainer.ranks.commands import CALLS, ITERATORS, Command, CommandError, decode, encode
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSpec

RECORDS = [
    TrajectoryRecord([1, 2, 3], [4, 5], [-0.1234567890123, -2.5e-9], [0, 1], 0.75, "g0", "length", "id-1"),
    TrajectoryRecord([7], [8], [-1.0], [3], -1.0),
]
SPEC = TrainingSpec(base_model_path="/models/qwen3", device="cuda", dtype="bfloat16",
               lora=LoraConfig(rank=8, alpha=16.0, dropout=0.05, target_modules=("q_proj", "v_proj"),
                               expert_mode="shared", use_rslora=True),
               loss=LossSpec(type="dapo", clip_eps_high=0.28, kl_coef=0.01, kl_estimator="k2"),
               optimizer=OptimizerSpec(learning_rate=3e-4, warmup_steps=5, micro_batch_tokens=64),
               seed=9, engine="megatron", limits=LimitsSpec(max_sequence_tokens=512, max_buffered_trajectories=7),
               recompute_proximal=True, megatron=MegatronSpec(tensor_parallel_size=2, expert_parallel_size=2))


def roundtrip(command: Command) -> Command:
    return decode(encode(command))


def test_job_spec_round_trips_exactly_including_fields_the_proto_lacks() -> None:
    back = roundtrip(Command("create", "engine-1", args={"spec": SPEC}))
    assert back.op == "create" and back.engine == "engine-1"
    assert back.args["spec"] == SPEC
    assert isinstance(back.args["spec"].lora.target_modules, tuple)


@pytest.mark.parametrize("loss", [None, LossSpec(type="gspo", entropy_coef=0.001, max_staleness=2)])
def test_records_and_loss_settings_round_trip(loss: LossSpec | None) -> None:
    for method in ("train_step", "forward_backward"):
        back = roundtrip(Command("call", "e", method, {"batch": RECORDS, "loss": loss}))
        assert back.args == {"batch": RECORDS, "loss": loss}
    back = roundtrip(Command("call", "e", "compute_logprobs", {"batch": RECORDS, "reference": True}))
    assert back.args == {"batch": RECORDS, "reference": True}


def test_paths_numbers_cursors_and_none_round_trip(tmp_path: Path) -> None:
    cursor = {"epoch": 2, "seen": [1, 2], "name": "ü"}
    back = roundtrip(Command("call", "e", "save_checkpoint", {"path": tmp_path / "ckpt", "data_cursor": cursor}))
    assert back.args == {"path": tmp_path / "ckpt", "data_cursor": cursor}
    back = roundtrip(Command("call", "e", "save_checkpoint", {"path": str(tmp_path), "data_cursor": None}))
    assert back.args == {"path": tmp_path, "data_cursor": None}
    for method in ("load_checkpoint", "export_adapter", "export_merged"):
        assert roundtrip(Command("call", "e", method, {"path": tmp_path})).args == {"path": tmp_path}
    assert roundtrip(Command("call", "e", "optim_step", {"lr": None, "adam": None})).args == {"lr": None, "adam": None}
    step = AdamStep(beta1=0.5, eps=1e-12, max_grad_norm=0.0)
    assert roundtrip(Command("call", "e", "optim_step", {"lr": 1e-7, "adam": step})).args == {"lr": 1e-7, "adam": step}
    assert roundtrip(Command("call", "e", "renumber", {"version": 12})).args == {"version": 12}
    for method in ITERATORS:
        assert roundtrip(Command("iter", "e", method)) == Command("iter", "e", method)
    for op in ("ping", "stop"):
        assert roundtrip(Command(op)) == Command(op)
    assert roundtrip(Command("close", "e")) == Command("close", "e")


def test_every_engine_method_is_covered() -> None:
    assert set(CALLS) | set(ITERATORS) == {
        "forward_backward", "train_step", "optim_step", "compute_logprobs", "save_checkpoint", "load_checkpoint",
        "export_adapter", "export_merged", "iter_adapter_tensors", "iter_merged_tensors", "iter_base_tensors",
        "renumber"}


def good(**change: object) -> bytes:
    body = json.loads(encode(Command("call", "e", "train_step", {"batch": RECORDS[:1], "loss": None})))
    body.update(change)
    return json.dumps(body).encode()


@pytest.mark.parametrize("data,problem", [
    (b"\xff\xfe", "not a JSON command"),
    (b"{not json", "not a JSON command"),
    (b"[1, 2]", "command must be an object"),
    (good(op="explode"), "unknown op 'explode'"),
    (good(method="__init__"), "unknown engine method '__init__'"),
    (good(engine=""), "needs an engine key"),
    (good(extra=1), "unknown command fields ['extra']"),
    (good(args={"batch": []}), "expected ['batch', 'loss']"),
    (good(args={"batch": [{"prompt_token_ids": [1]}], "loss": None}), "batch[0]"),
    (good(args={"batch": [{**json.loads(good())["args"]["batch"][0], "prompt_token_ids": ["a"]}], "loss": None}),
     "batch[0].prompt_token_ids must hold integers"),
    (good(args={"batch": [], "loss": {"name": "nope"}}), "loss:"),
    (json.dumps({"op": "call", "engine": "e", "method": "optim_step", "args": {"lr": "fast", "adam": None}}).encode(),
     "lr must be a number"),
    (json.dumps({"op": "call", "engine": "e", "method": "optim_step",
                 "args": {"lr": 1.0, "adam": {"beta3": 0.5}}}).encode(), "adam: optimizer.step expected"),
    (json.dumps({"op": "call", "engine": "e", "method": "optim_step",
                 "args": {"lr": 1.0, "adam": {"eps": "tiny"}}}).encode(), "adam: optimizer.eps must be a number"),
    (json.dumps({"op": "call", "engine": "e", "method": "load_checkpoint", "args": {"path": ""}}).encode(),
     "path must be a non-empty string"),
    (json.dumps({"op": "create", "engine": "e", "args": {"spec": {"base_model_path": "x"}}}).encode(), "spec"),
    (json.dumps({"op": "ping", "method": "train_step"}).encode(), "takes no method"),
])
def test_malformed_commands_are_refused_saying_why(data: bytes, problem: str) -> None:
    with pytest.raises(CommandError) as err:
        decode(data)
    assert problem in str(err.value)


def test_encode_refuses_what_could_not_be_decoded() -> None:
    with pytest.raises(CommandError, match="expected"):
        encode(Command("call", "e", "optim_step", {}))
    with pytest.raises(CommandError, match="not JSON-encodable"):
        encode(Command("call", "e", "save_checkpoint", {"path": "p", "data_cursor": object()}))
