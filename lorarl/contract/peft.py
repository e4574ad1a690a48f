"""PEFT LoRA adapters as every service names, pairs, reads and writes them: one definition.

A tensor of an adapter is ``base_model.model.<module>.lora_A.weight`` (``[rank, in]``) or ``...lora_B.weight``
(``[out, rank]``); an adapter directory is adapter_config.json (lorarl.contract.lora.LoraSpec.peft_config writes
it) beside adapter_model.safetensors. The trainer writes these names, weight sync checks them against a job's
catalog, the rollout loads them into its engines, and a teacher or a warm start is read back from them: all
through this module, so a name means the same adapter everywhere.

The pickled adapter_model.bin older PEFT versions wrote is refused (no pickle is read anywhere); convert
it with PEFT (``save_pretrained(..., safe_serialization=True)``).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

PREFIX = "base_model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
NAME_PATTERN = f"{PREFIX}<module>.lora_A|lora_B.weight"
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")

Half = Literal["A", "B"]
T = TypeVar("T")


class PeftNameError(ValueError):
    """Tensors that are not one PEFT LoRA adapter: a name outside the pattern, or a module with one half."""


def tensor_name(module: str, which: Half) -> str:
    """The PEFT name of ``module``'s lora_A or lora_B tensor (``module``: the model's own dotted name)."""
    return f"{PREFIX}{module}.lora_{which}.weight"


def parse_tensor_name(name: str) -> tuple[str, Half] | None:
    """(module, 'A' | 'B') for a PEFT adapter tensor name, else None."""
    m = _NAME.match(name)
    return (m["module"], m["which"]) if m else None  # type: ignore[return-value]


def pair_tensors(tensors: Mapping[str, T]) -> dict[str, tuple[T, T]]:
    """{module: (lora_A, lora_B)}; PeftNameError names a tensor outside the pattern or the modules missing a half."""
    halves: dict[str, dict[str, T]] = {}
    for name, tensor in tensors.items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise PeftNameError(f"{name!r} is not a PEFT LoRA tensor name ({NAME_PATTERN})")
        halves.setdefault(parsed[0], {})[parsed[1]] = tensor
    lone = sorted(m for m, h in halves.items() if len(h) != 2)
    if lone:
        raise PeftNameError(f"lora_A or lora_B missing for {lone[:3]}")
    return {module: (h["A"], h["B"]) for module, h in halves.items()}


def adapted_leaves(names: Iterable[str], known: Iterable[str] = ()) -> list[str]:
    """The leaf module names (q_proj, in_proj_qkv, ...) PEFT tensor ``names`` adapt, for target_modules;
    restricted to ``known`` leaves when any of them is among them (expert tensors name the projection)."""
    leaves = {parsed[0].rsplit(".", 1)[-1] for name in names if (parsed := parse_tensor_name(name))}
    return sorted(leaves & set(known)) or sorted(leaves)


def read_peft_config(directory: str | Path) -> dict[str, Any]:
    """adapter_config.json; ValueError says what is missing or malformed."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{str(directory)!r} is not a directory")
    if not (directory / WEIGHTS).is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        raise ValueError(f"{str(directory)!r} has no {WEIGHTS}" + (
            " (adapter_model.bin is a pickle, which lorarl does not read: re-save it with safetensors)"
            if pickled else ""))
    try:
        config = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(directory)!r} has no {CONFIG}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / CONFIG} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{directory / CONFIG} is not a JSON object")
    return config


def read_peft_tensors(directory: str | Path) -> dict[str, Any]:
    """adapter_model.safetensors's tensors by PEFT name (read without pickle)."""
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / WEIGHTS))


def write_peft_files(directory: str | Path, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> Path:
    """Writes adapter_model.safetensors and adapter_config.json into ``directory`` (made if missing); callers that
    publish atomically write into a scratch directory and rename it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS),
              metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(dict(config), indent=2))
    return directory


def safetensors_shapes(paths: Iterable[str | Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in these safetensors files, from their headers alone (nothing loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in paths:
        with Path(path).open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update({name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"})
    return shapes


def fit_problems(adapter_dir: str | Path, model_dir: str | Path, most: int = 3) -> list[str]:
    """Why the adapter in ``adapter_dir`` cannot apply to the base in ``model_dir`` (empty: it can, or the base's
    weights are not there to read): a module the base lacks, or halves whose shapes miss its weight's
    ([rank, in] and [out, rank] against [out, in]). At most ``most`` lines."""
    base_files = sorted(Path(model_dir).glob("*.safetensors"))
    if not base_files:
        return []
    base = safetensors_shapes(base_files)
    problems = []
    try:
        pairs = pair_tensors(safetensors_shapes([Path(adapter_dir) / WEIGHTS]))
    except PeftNameError as e:
        return [str(e)]
    for module, (a, b) in sorted(pairs.items()):
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight) != 2:
            problems.append(f"{module} is not a linear layer of the base")
        elif len(a) != 2 or len(b) != 2 or a[1] != weight[1] or b[0] != weight[0] or a[0] != b[1]:
            problems.append(f"{module}: lora_A {list(a)} and lora_B {list(b)} do not fit its weight {list(weight)}")
        if len(problems) >= most:
            break
    return problems

