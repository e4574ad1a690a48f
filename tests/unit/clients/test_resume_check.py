"""Resuming with a changed job file: a change the saved state depends on is refused before anything starts,
naming each key old -> new and --fresh; any other change goes ahead with a one-line note."""

from __future__ import annotations

import json
from pathlib import Path

from lorarl.client.cli import main
from lorarl.client.job.config import load_job_config
from lorarl.client.job.resume_check import (
    SAVED,
    STATE_KEYS,
    changes,
    leaf_keys,
    resume_ok,
    saved_settings,
    settings,
)

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "examples/demo.yaml")


def job(out: Path, *overrides: str):
    return load_job_config(DEMO, [f"output.dir={out}", *overrides])


def saved_state(out: Path, step: int = 10) -> None:
    (out / "state.json").write_text(json.dumps({"step": step, "version": step + 1, "cursor": 160,
                                                "checkpoint": str(out / "checkpoints/demo/resume")}))


def test_every_state_key_is_a_setting_and_a_section_stands_for_its_keys() -> None:
    keys = leaf_keys()
    assert all(any(k == key or k.startswith(f"{key}.") for k in keys) for key in STATE_KEYS)
    refused, noted = changes(settings(job(Path("runs/x"))), settings(job(
        Path("runs/x"), "trainer.lora.rank=16", "trainer.optimizer.learning_rate=0.01", "loop.steps=80",
        "output.progress=false", "data.columns={prompt: q}")))
    assert [c.key for c in refused] == ["data.columns", "trainer.lora.rank", "trainer.optimizer.learning_rate"]
    assert [str(c) for c in noted] == ["loop.steps 40 -> 80", "output.progress true -> false"]


def test_a_first_start_saves_its_settings_and_a_resume_compares_with_them(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert resume_ok(job(out), fresh=False)  # nothing to resume: the settings are recorded
    assert saved_settings(out)["model"]["path"] == "lorarl/assets/models/qwen3-tiny"  # as the job file names it
    saved_state(out)
    assert resume_ok(job(out), fresh=False) and capsys.readouterr().out == ""
    assert resume_ok(job(out, "loop.steps=80", "loop.eval_every=5"), fresh=False)
    said = capsys.readouterr().out
    assert said.strip() == (f"lorarl: resuming {out} from step 10 with changed settings: loop.steps 40 -> 80, "
                            "loop.eval_every 10 -> 5")
    assert resume_ok(job(out, "loop.steps=80", "loop.eval_every=5"), fresh=False)  # recorded: said once
    assert capsys.readouterr().out == ""

    assert not resume_ok(job(out, "trainer.lora.rank=16", "model.path=Qwen/Qwen3-0.6B"), fresh=False)
    err = capsys.readouterr().err
    assert f"{out} holds a resume point (step 10) saved under other settings" in err
    assert '  model.path: "lorarl/assets/models/qwen3-tiny" -> "Qwen/Qwen3-0.6B"' in err
    assert "  trainer.lora.rank: 8 -> 16  (the adapter's shape and scale)" in err and "--fresh" in err
    assert json.loads((out / SAVED).read_text())["trainer"]["lora"]["rank"] == 8  # a refused start records nothing

    assert resume_ok(job(out, "trainer.lora.rank=16"), fresh=True)  # starting over: the new settings are recorded
    assert json.loads((out / SAVED).read_text())["trainer"]["lora"]["rank"] == 16


def test_a_run_dir_from_before_compares_with_its_config_json_but_not_the_model_folder(tmp_path: Path, capsys) -> None:
    out = tmp_path / "old"
    out.mkdir()
    legacy = json.loads(json.dumps(settings(job(out))))
    legacy["model"]["path"] = "/elsewhere/qwen3-tiny"  # the folder of the host it ran on
    (out / "config.json").write_text(json.dumps(legacy))
    saved_state(out, step=3)
    assert resume_ok(job(out), fresh=False) and capsys.readouterr().out == ""
    (out / SAVED).unlink()
    assert not resume_ok(job(out, "data.seed=7"), fresh=False)
    assert "  data.seed: 0 -> 7" in capsys.readouterr().err


def test_lorarl_run_refuses_before_any_service_starts(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert resume_ok(job(out), fresh=False)
    saved_state(out)
    assert main(["run", DEMO, f"output.dir={out}", "rollout.group_size=4"]) == 2
    err = capsys.readouterr().err
    assert "rollout.group_size: 8 -> 4" in err and "pass --fresh" in err
    assert not (out / "services").exists()
