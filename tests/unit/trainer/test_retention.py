"""Checkpoint retention keeps the newest step checkpoints and never touches other names."""

from pathlib import Path

from lorarl.trainer.service.retention import prune_step_checkpoints


def test_the_newest_step_checkpoints_stay_and_other_names_are_never_removed(tmp_path: Path) -> None:
    for name in ("step-000010", "step-000020", "step-000030", "resume", "final-adapter", "step-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-000005").write_text("a file, not a checkpoint")
    removed = prune_step_checkpoints(tmp_path / "step-000030", keep_last=2)
    assert [p.name for p in removed] == ["step-000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final-adapter", "resume", "step-000005", "step-000020",
                                                          "step-000030", "step-x"]
    # a save under another name keeps keep_last step checkpoints; 0 keeps all
    assert [p.name for p in prune_step_checkpoints(tmp_path / "resume", keep_last=1)] == ["step-000020"]
    assert prune_step_checkpoints(tmp_path / "step-000030", keep_last=0) == []
    assert (tmp_path / "step-000030").is_dir()
