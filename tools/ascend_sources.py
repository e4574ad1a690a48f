"""Fetches the Python source of the vLLM and vllm-ascend releases the Ascend image pins, into a cache.

The Ascend stack cannot be installed here (it needs CANN and torch_npu), so the compatibility test
(tests/unit/rollout/test_vllm_surface.py) reads these releases' source instead. `make ascend-sources`
runs this once; CI does not (the test then skips and says how to run it). Each sdist is checked
against its sha256 from PyPI before anything is unpacked; only .py files are kept.
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "ascend-sources"

#: What deploy/docker/Dockerfile.ascend's base image (quay.io/ascend/vllm-ascend:v0.23.0) holds.
RELEASES: dict[str, tuple[str, str]] = {
    "vllm-0.23.0": (
        "https://files.pythonhosted.org/packages/68/c6/c4dc766b09e93de278693502612de0beba822983d4f609830406ead65cc9/"
        "vllm-0.23.0.tar.gz",
        "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5"),
    "vllm_ascend-0.23.0": (
        "https://files.pythonhosted.org/packages/87/6c/df89ded4efdd5591b7ae2ec72bc00a721ac30c4a241b2882d8bd53c3bd58/"
        "vllm_ascend-0.23.0.tar.gz",
        "a58db76eaffcf328b13b315a0db3a57d381a8947d01057ddcefe4ad02372b242"),
}


def roots(cache: Path = CACHE) -> list[Path]:
    """The unpacked source roots (each holding vllm/ or vllm_ascend/), empty when not fetched."""
    found = [cache / name for name in RELEASES]
    return found if all((root / ".complete").is_file() for root in found) else []


def fetch(name: str, cache: Path = CACHE) -> Path:
    url, sha256 = RELEASES[name]
    root = cache / name
    if (root / ".complete").is_file():
        return root
    with urllib.request.urlopen(url, timeout=300) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{url}: sha256 {digest}, expected {sha256}; not unpacked")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and member.name.endswith(".py") and len(parts) > 1 and ".." not in parts:
                target = root.joinpath(*parts[1:])
                target.parent.mkdir(parents=True, exist_ok=True)
                extracted = tar.extractfile(member)
                assert extracted is not None
                target.write_bytes(extracted.read())
    (root / ".complete").write_text(sha256 + "\n")
    return root


def main() -> int:
    for name in RELEASES:
        print(f"{name}: {fetch(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
