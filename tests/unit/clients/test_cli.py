"""The command line takes KEY=VALUE overrides anywhere after the config file, as its help shows them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.client.cli import main, parse

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "examples/demo.yaml")


def test_overrides_before_between_and_after_flags_keep_their_order() -> None:
    args = parse(["run", DEMO, "loop.steps=3", "--dry-run", "loop.steps=4", "--fresh", "rollout.group_size=2"])
    assert args.dry_run and args.fresh
    assert args.overrides == ["loop.steps=3", "loop.steps=4", "rollout.group_size=2"]
    args = parse(["eval", DEMO, "--adapter", "runs/x", "data.eval_size=5", "--adapter", "runs/y", "--base"])
    assert args.adapter == ["runs/x", "runs/y"] and args.base and args.overrides == ["data.eval_size=5"]
    assert parse(["demo", "--fresh", "loop.steps=2"]).overrides == ["loop.steps=2"]


def test_an_override_after_the_flags_reaches_the_plan(capsys) -> None:
    assert main(["run", DEMO, "--dry-run", "loop.steps=7"]) == 0
    assert "7 steps" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["run", DEMO, "--dry-run", "--bogus"], ["run", DEMO, "--dry-run", "stray"],
                                  ["export", "job", "--checkpoint", "x", "loop.steps=2"]])
def test_what_is_neither_a_flag_nor_an_override_is_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_version_names_the_installed_release(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"lorarl {version('lorarl')}"
