"""`lorarl run JOB --attach RUN_DIR` (lorarl.client.launch.attach): the owner's addresses read from its folder, the
jobs that cannot share its services refused by name, and the leases that keep the owner's services up while an
attached run is alive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.client.job.config import load_job_config
from lorarl.client.launch.attach import attached_jobs, check_attachable, lease, stack_addresses, wait_for_attached
from lorarl.client.launch.services import stack_sections
from lorarl.common.config import ConfigError, to_dict

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "multitenant"


def owner_dir(tmp: Path, *overrides: str, rank: int = 16, lora: bool = True) -> Path:
    """An owner's output dir as `lorarl run tools.yaml` leaves it while running: its config and its stack (with
    what its rollout's engine said it serves as adapters)."""
    cfg = load_job_config(str(EXAMPLE / "tools.yaml"), list(overrides))
    (tmp / "services").mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(to_dict(cfg)))
    served = {"supports_lora": lora, "max_lora_rank": rank if lora else 0, "engine": "vllm",
              "reason": "" if lora else "Qwen3-MoE LoRA does not run on vLLM's CPU backend"}
    (tmp / "services" / "stack.json").write_text(json.dumps({"trainer": "127.0.0.1:1", "weightsync": "127.0.0.1:2",
                                                             "rollout": ["127.0.0.1:3"], "openai": [],
                                                             "max_lora_rank": rank, "max_loras": 10, "lora": served}))
    return tmp


def test_a_job_that_can_share_attaches_and_others_are_refused_by_name(tmp_path: Path) -> None:
    run_dir = owner_dir(tmp_path / "tools")
    assert stack_addresses(run_dir)["trainer"] == "127.0.0.1:1"
    sort = load_job_config(str(EXAMPLE / "sort.yaml"), [])
    check_attachable(sort, run_dir)
    # one rule with `lorarl run A B` (lorarl.contract.sharing): the same keys, the same words
    for overrides, message in ((["model.dtype=bfloat16"], r"model.dtype: the stack in .*: jobs tools and sort "
                                                          r"differ \('float32' vs 'bfloat16'\)"),
                               (["rollout.block_size=32"], "rollout.block_size: the stack in .*: jobs tools and sort"),
                               (["sync.mode=merged"], "jobs share a rollout in adapter mode only"),
                               (["job_id=tools"], "'tools' is the owner's job")):
        with pytest.raises(ConfigError, match=message):
            check_attachable(load_job_config(str(EXAMPLE / "sort.yaml"), overrides), run_dir)
    with pytest.raises(ConfigError, match=r"trainer.lora.rank: .*LoRA rank 16 is above the rank this shared rollout "
                                          r"serves \(rollout\.max_lora_rank=8\).* start the rollout with "
                                          r"rollout\.max_lora_rank=16 or more"):
        check_attachable(sort, owner_dir(tmp_path / "small", rank=8))
    with pytest.raises(ConfigError, match=r"does not support LoRA \(Qwen3-MoE LoRA does not run on vLLM's CPU "
                                          r"backend\): an adapter would be merged into the base"):
        check_attachable(sort, owner_dir(tmp_path / "no-lora", lora=False))
    with pytest.raises(ConfigError, match="no stack in"):
        stack_addresses(tmp_path / "nowhere")


def test_a_lease_holds_the_owner_while_its_process_lives(tmp_path: Path) -> None:
    workdir = owner_dir(tmp_path / "tools") / "services"
    with lease(workdir.parent, "sort"):
        assert attached_jobs(workdir) == ["sort"]
    assert attached_jobs(workdir) == []
    wait_for_attached(workdir)  # none: returns at once
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (workdir / "attached" / "ghost").write_text(gone.stdout.strip())  # a run that died without its cleanup
    assert attached_jobs(workdir) == [] and not (workdir / "attached" / "ghost").exists()


def test_the_owner_can_keep_adapter_slots_for_jobs_to_come(tmp_path: Path) -> None:
    cfg = load_job_config(str(EXAMPLE / "tools.yaml"), [])
    assert stack_sections(cfg, tmp_path)["rollout"]["max_loras"] == 2 + 2 + 1
    roomy = load_job_config(str(EXAMPLE / "tools.yaml"), ["rollout.max_loras=12"])
    assert stack_sections(roomy, tmp_path)["rollout"]["max_loras"] == 12
