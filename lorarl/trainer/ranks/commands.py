"""The commands trainer rank 0 sends its follower ranks, as JSON bytes (never pickle).

A multi-rank engine only works if every rank makes the same engine call with the same arguments,
so rank 0 encodes each call here, broadcasts the bytes (lorarl.trainer.ranks.control) and every rank,
rank 0 included, runs the *decoded* call: a codec bug shows up on all ranks alike instead of
making them diverge. Arguments travel as plain JSON: trajectory records and settings as dicts of
their dataclass fields, paths as strings. A command that does not decode to exactly this schema
is refused with a CommandError saying what is wrong.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorarl.contract.errors import SpecError
from lorarl.contract.routes import RoutedExperts
from lorarl.trainer.engines.api import (
    AdamStep,
    LimitsSpec,
    MegatronSpec,
    MemorySpec,
    OptimizerSpec,
    TrainingSpec,
    TrajectoryRecord,
)
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSpec
from lorarl.v1 import common_pb2

#: create: build an engine under `engine`; call / iter: run an engine method; close: forget an engine;
#: ping: do nothing (rank 0's heartbeat); stop: leave the follower loop.
OPS = ("create", "call", "iter", "close", "ping", "stop")
#: Engine methods a command may call, and the arguments each takes (all of them, always present).
CALLS: dict[str, tuple[str, ...]] = {
    "forward_backward": ("batch", "loss"),
    "train_step": ("batch", "loss"),
    "optim_step": ("lr", "adam"),
    "compute_logprobs": ("batch", "reference"),
    "save_checkpoint": ("path", "data_cursor"),
    "load_checkpoint": ("path",),
    "renumber": ("version",),
    "export_adapter": ("path",),
    "export_merged": ("path",),
}
#: Iterator methods: every rank runs them to the end (they hold tensor-parallel gathers).
ITERATORS = ("iter_adapter_tensors", "iter_merged_tensors", "iter_base_tensors")


class CommandError(ValueError):
    """The bytes are not a well-formed command."""


@dataclass(frozen=True)
class Command:
    """One instruction to every rank; ``args`` holds the decoded Python values."""

    op: str
    engine: str = ""
    method: str = ""
    args: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- values


def spec_to_json(spec: TrainingSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_from_json(raw: Any) -> TrainingSpec:
    d = _dict(raw, "spec")
    try:
        lora = _dict(d.get("lora"), "spec.lora")
        return TrainingSpec(**{
            **d,
            "lora": LoraConfig(**{**lora, "target_modules": tuple(_list(lora.get("target_modules"),
                                                                        "spec.lora.target_modules"))}),
            "loss": _loss(d.get("loss"), "spec.loss"),
            "optimizer": OptimizerSpec(**_dict(d.get("optimizer"), "spec.optimizer")),
            "limits": LimitsSpec(**_dict(d.get("limits"), "spec.limits")),
            "megatron": MegatronSpec(**_dict(d.get("megatron"), "spec.megatron")),
            "memory": MemorySpec(**_dict(d.get("memory"), "spec.memory")),
        })
    except (TypeError, ValueError) as e:
        raise CommandError(f"spec: {e}") from None


def record_to_json(record: TrajectoryRecord) -> dict[str, Any]:
    d = dataclasses.asdict(dataclasses.replace(record, routes=None))
    if record.routes is not None:  # their wire form (lorarl.contract.routes), the bytes as base64
        msg = record.routes.to_proto()
        d["routes"] = {"data": base64.b64encode(msg.data).decode(), "positions": msg.positions, "layers": msg.layers,
                       "top_k": msg.top_k, "num_experts": msg.num_experts}
    return d


def record_from_json(raw: Any, where: str) -> TrajectoryRecord:
    d = _dict(raw, where)
    try:
        routes = d.pop("routes", None)
        if routes is not None:
            fields = _dict(routes, f"{where}.routes")
            d["routes"] = RoutedExperts.from_proto(common_pb2.RoutedExperts(
                **{**fields, "data": base64.b64decode(str(fields.get("data", "")), validate=True)}))
        if d.get("routes_problem") is not None:
            d["routes_problem"] = tuple(_list(d["routes_problem"], f"{where}.routes_problem"))
        record = TrajectoryRecord(**d)
    except (TypeError, ValueError) as e:
        raise CommandError(f"{where}: {e}") from None
    for name in ("prompt_token_ids", "completion_token_ids", "token_versions"):
        if not all(type(v) is int for v in _list(getattr(record, name), f"{where}.{name}")):
            raise CommandError(f"{where}.{name} must hold integers")
    if not all(isinstance(v, float | int) for v in _list(record.behavior_logprobs, f"{where}.behavior_logprobs")):
        raise CommandError(f"{where}.behavior_logprobs must hold numbers")
    if record.loss_mask is not None and not all(type(v) is bool for v in _list(record.loss_mask, f"{where}.loss_mask")):
        raise CommandError(f"{where}.loss_mask must hold booleans")
    if not all(isinstance(v, float | int) for v in _list(record.turn_rewards, f"{where}.turn_rewards")):
        raise CommandError(f"{where}.turn_rewards must hold numbers")
    return record


def loss_to_json(loss: LossSpec | None) -> dict[str, Any] | None:
    return None if loss is None else dataclasses.asdict(loss)


def loss_from_json(raw: Any) -> LossSpec | None:
    if raw is None:
        return None
    try:
        return _loss(raw, "loss")
    except (TypeError, ValueError) as e:
        raise CommandError(f"loss: {e}") from None


def _loss(raw: Any, where: str) -> LossSpec:
    return LossSpec.from_dict(_dict(raw, where))


def _dict(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise CommandError(f"{where} must be an object, got {type(raw).__name__}")
    return raw


def _list(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list | tuple):
        raise CommandError(f"{where} must be a list, got {type(raw).__name__}")
    return list(raw)


_ENCODERS: dict[str, Any] = {
    "batch": lambda v: [record_to_json(r) for r in v],
    "loss": loss_to_json,
    "lr": lambda v: None if v is None else float(v),
    "adam": lambda v: None if v is None else v.to_json(),
    "reference": bool,
    "path": str,
    "version": int,
    "data_cursor": lambda v: v,
    "spec": spec_to_json,
}


def _decode_value(name: str, raw: Any) -> Any:
    if name == "batch":
        return [record_from_json(r, f"batch[{i}]") for i, r in enumerate(_list(raw, "batch"))]
    if name == "loss":
        return loss_from_json(raw)
    if name == "lr":
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, float | int)):
            raise CommandError(f"lr must be a number or null, got {raw!r}")
        return None if raw is None else float(raw)
    if name == "adam":
        try:
            return AdamStep.from_json(raw)
        except SpecError as e:
            raise CommandError(f"adam: {e}") from None
    if name == "reference":
        if not isinstance(raw, bool):
            raise CommandError(f"reference must be true or false, got {raw!r}")
        return raw
    if name == "path":
        if not isinstance(raw, str) or not raw:
            raise CommandError(f"path must be a non-empty string, got {raw!r}")
        return Path(raw)
    if name == "version":
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
            raise CommandError(f"version must be a non-negative integer, got {raw!r}")
        return raw
    if name == "spec":
        return spec_from_json(raw)
    return raw  # data_cursor: the caller's opaque JSON value


# ---------------------------------------------------------------- commands


def _arg_names(op: str, method: str) -> tuple[str, ...]:
    if op not in OPS:
        raise CommandError(f"unknown op {op!r}; expected one of {list(OPS)}")
    if op == "call":
        if method not in CALLS:
            raise CommandError(f"unknown engine method {method!r}; expected one of {sorted(CALLS)}")
        return CALLS[method]
    if op == "iter":
        if method not in ITERATORS:
            raise CommandError(f"unknown iterator {method!r}; expected one of {list(ITERATORS)}")
        return ()
    if method:
        raise CommandError(f"op {op!r} takes no method, got {method!r}")
    return ("spec",) if op == "create" else ()


def encode(command: Command) -> bytes:
    """The command as UTF-8 JSON; refuses (CommandError) what could not be decoded again."""
    names = _arg_names(command.op, command.method)
    if set(command.args) != set(names):
        raise CommandError(f"{command.op} {command.method}: arguments {sorted(command.args)}, expected {list(names)}")
    if command.op in ("create", "call", "iter", "close") and not command.engine:
        raise CommandError(f"op {command.op!r} needs an engine key")
    body = {"op": command.op, "engine": command.engine, "method": command.method,
            "args": {n: _ENCODERS[n](command.args[n]) for n in names}}
    try:
        return json.dumps(body, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise CommandError(f"{command.op} {command.method}: not JSON-encodable: {e}") from None


def decode(data: bytes) -> Command:
    """Bytes from encode() back to a Command with Python values; CommandError says what is malformed."""
    try:
        body = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise CommandError(f"not a JSON command: {e}") from None
    body = _dict(body, "command")
    unknown = set(body) - {"op", "engine", "method", "args"}
    if unknown:
        raise CommandError(f"unknown command fields {sorted(unknown)}")
    op, engine, method = body.get("op"), body.get("engine", ""), body.get("method", "")
    if not isinstance(op, str) or not isinstance(engine, str) or not isinstance(method, str):
        raise CommandError("op, engine and method must be strings")
    names = _arg_names(op, method)
    if op in ("create", "call", "iter", "close") and not engine:
        raise CommandError(f"op {op!r} needs an engine key")
    args = _dict(body.get("args", {}), "args")
    if set(args) != set(names):
        raise CommandError(f"{op} {method}: arguments {sorted(args)}, expected {list(names)}")
    return Command(op, engine, method, {n: _decode_value(n, args[n]) for n in names})
