"""The job-file key reference (docs/job-file.md), generated from the typed config itself.

    python -m lorarl.client.job.reference            # print it
    python -m lorarl.client.job.reference --write    # rewrite docs/job-file.md

Every key `lorarl run` accepts, with its type, default and the doc string its field declares
(lorarl.common.config.describe_keys); tests/unit/test_job_file_reference.py fails when the page is stale,
so the reference cannot say what the code does not.
"""

from __future__ import annotations

import argparse
import json
from itertools import groupby
from pathlib import Path
from typing import Any

from lorarl.client.job.config import JobFileConfig
from lorarl.common.config import describe_keys

PAGE = Path(__file__).resolve().parents[3] / "docs" / "job-file.md"

HEADER = """# Job-file keys

Every key a job file (`lorarl run JOB.yaml`) takes, with its type and default. Any key can also be given on the
command line as `section.key=value` (`lorarl run examples/demo.yaml loop.steps=20 trainer.lora.rank=16`); a wrong
key, type or value is refused before anything starts, naming the key. A complete example: `examples/demo.yaml`.

Generated from the config classes (`lorarl/client/job/config.py`, `lorarl/contract/training.py`) by
`python -m lorarl.client.job.reference --write`; a test fails when this page is stale. Do not edit by hand.
"""


def _value(default: Any) -> str:
    text = json.dumps(default)
    return f"`{text}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole page, one table per top-level section."""
    keys = describe_keys(JobFileConfig)
    lines = [HEADER]
    for section, group in groupby(keys, key=lambda k: k.key.split(".", 1)[0] if "." in k.key else ""):
        lines.append(f"\n## `{section}`\n" if section else "\n## Top level\n")
        lines.append("| key | type | default | what it does |")
        lines.append("| --- | --- | --- | --- |")
        for k in group:
            lines.append(f"| `{k.key}` | {_cell(k.kind)} | {_value(k.default)} | {_cell(k.doc)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="Print (or --write) the job-file key reference, docs/job-file.md.")
    parser.add_argument("--write", action="store_true", help=f"rewrite {PAGE}")
    args = parser.parse_args()
    if args.write:
        PAGE.write_text(render())
        print(f"wrote {PAGE}")
    else:
        print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
