"""A PEFT LoRA adapter directory as lorarl reads one: adapter_config.json and adapter_model.safetensors.

The pickled adapter_model.bin older PEFT versions wrote is refused (no pickle is read anywhere); convert
it with PEFT (``save_pretrained(..., safe_serialization=True)``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


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
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / WEIGHTS))
