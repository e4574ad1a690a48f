"""A cheap, stable identity for a base checkpoint, so adapters are never applied to the wrong model.

Hashes the config (canonical JSON, minus fields that change with the library version that saved it),
every safetensors tensor's name, dtype and shape, and the bytes of the first and last tensors
(capped), read straight from the files: no model is loaded and no weights are materialised.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
CONTENT_BYTES = 4 << 20


def _header(path: Path) -> tuple[int, dict]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return 8 + size, json.loads(f.read(size))


def base_model_fingerprint(model_dir: str | Path) -> str:
    """``sha256:<32 hex>`` over config.json and the safetensors layout plus sampled content."""
    root = Path(model_dir)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ValueError(f"base_model_path {root} has no config.json")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"base_model_path {root} has no *.safetensors weights")
    digest = hashlib.sha256()
    config = json.loads(config_path.read_text())
    for key in VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    entries: list[tuple[str, dict, Path, int]] = []
    for file in files:
        data_start, header = _header(file)
        entries += [(name, info, file, data_start) for name, info in header.items() if name != "__metadata__"]
    entries.sort(key=lambda e: e[0])
    for name, info, _, _ in entries:
        digest.update(f"{name}|{info['dtype']}|{info['shape']}\n".encode())
    sampled = entries[:1] if len(entries) == 1 else [entries[0], entries[-1]]
    for _name, info, file, data_start in sampled:
        begin, end = info["data_offsets"]
        with file.open("rb") as f:
            f.seek(data_start + begin)
            digest.update(f.read(min(end - begin, CONTENT_BYTES)))
    return f"sha256:{digest.hexdigest()[:32]}"
