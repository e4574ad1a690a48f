"""Resolves the install sets of the platforms CI cannot install (`[cuda]`, `[ascend]`) against PyPI into lock
files, reading metadata only: pip's `install --dry-run --report` takes each wheel's PEP 658 metadata from
the index instead of downloading multi-GB CUDA wheels. `make lock-platforms` runs it; CI does not (it has
no business resolving against the live index) — tests/unit/test_platform_locks.py checks offline that each
lock still agrees with its inputs and with pyproject's extras.

- cuda: requirements/base.txt + common.txt + cuda.txt (`pip install '.[cuda]'`), for this interpreter's
  platform (Linux x86_64, CPython 3.11: the CUDA image's).
- ascend: base.txt + ascend.txt (`pip install '.[ascend]'`) under requirements/ascend-image.txt as
  constraints: what the vllm-ascend v0.23.0 image already holds (torch, torch-npu, vLLM, vllm-ascend,
  transformers), so the resolution shows lorarl adding to that stack and never replacing any of it.

Each lock's header records the sha256 of its inputs, so a changed requirement file without a new lock
fails the offline test, naming this command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQ = ROOT / "requirements"
INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Platform:
    requirements: tuple[str, ...]
    constraints: tuple[str, ...]
    lock: str

    def inputs(self) -> list[Path]:
        return [REQ / name for name in (*self.requirements, *self.constraints)]


PLATFORMS = {
    "cuda": Platform(("base.txt", "common.txt", "cuda.txt"), (), "cuda-lock.txt"),
    "ascend": Platform(("base.txt", "ascend.txt"), ("ascend-image.txt",), "ascend-lock.txt"),
}


def inputs_digest(platform: Platform) -> str:
    digest = hashlib.sha256()
    for path in platform.inputs():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def resolve(platform: Platform) -> list[tuple[str, str, str]]:
    """(name, version, sha256) of every distribution pip would install, from a clean, isolated pip (no
    machine config, find-links or constraints of this host), against PyPI alone."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
                   "--index-url", INDEX, "--report", str(report)]
        for name in platform.requirements:
            command += ["-r", str(REQ / name)]
        for name in platform.constraints:
            command += ["-c", str(REQ / name)]
        subprocess.run(command, check=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
        installs = json.loads(report.read_text())["install"]
    return sorted((item["metadata"]["name"], item["metadata"]["version"],
                   item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256", ""))
                  for item in installs)


def write_lock(name: str, platform: Platform, pins: list[tuple[str, str, str]]) -> Path:
    lines = [f"# The {name} install set resolved against {INDEX} (metadata only): `make lock-platforms`",
             f"# (tools/lock_platforms.py). Inputs: {', '.join(p.name for p in platform.inputs())}",
             f"# inputs-sha256: {inputs_digest(platform)}"]
    lines += [f"{dist}=={version}" + (f" --hash=sha256:{sha}" if sha else "") for dist, version, sha in pins]
    path = REQ / platform.lock
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("platforms", nargs="*", help=f"of {sorted(PLATFORMS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.platforms) - set(PLATFORMS))
    if unknown:
        parser.error(f"unknown platform(s) {unknown}; known: {sorted(PLATFORMS)}")
    for name in args.platforms or sorted(PLATFORMS):
        platform = PLATFORMS[name]
        path = write_lock(name, platform, resolve(platform))
        print(f"{name}: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
