"""Rebuild the shipped assets, or make a random-init benchmark model: ``python -m lorarl.assets.build --help``.

    python -m lorarl.assets.build                          # tokenizer, task splits, the tiny policies
    python -m lorarl.assets.build --only tokenizer tasks   # just those parts
    python -m lorarl.assets.build --shape qwen3-0.6b --layers 4 --out /tmp/q06b
    python -m lorarl.assets.build --shape qwen3-30b-a3b --layers 2 --experts 32 --out /tmp/q30b

The tiny policies train in parallel, one process and one torch thread each: that keeps every run
bit-for-bit reproducible on a given machine. The dense, MoE and tool policies build from scratch, at once;
the mixed one then warm-starts from the tool policy (~9 min more on one core).
Each model directory gets a ``build_info.json`` with its parameters, training recipe and measured
held-out numbers (no timings, so a rebuild on the same machine leaves every file byte-identical).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.assets.paths import (
    DENSE_MODEL_DIR,
    MIXED_MODEL_DIR,
    MOE_MODEL_DIR,
    TASKS_DIR,
    TOKENIZER_DIR,
    TOOLS_MODEL_DIR,
)
from lorarl.assets.pretrain import SFTConfig

PARTS = ("tokenizer", "tasks", "dense", "moe", "tools", "mixed")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TinyRecipe:
    """How one shipped policy is made: its shape, where it goes and its SFT run."""

    shape: str
    out_dir: Path
    sft: SFTConfig
    start_from: Path | None = None  # a shipped model to warm-start from (built before this one)


RECIPES: dict[str, TinyRecipe] = {
    "dense": TinyRecipe(shape="qwen3-tiny", out_dir=DENSE_MODEL_DIR, sft=SFTConfig(seed=0)),
    "moe": TinyRecipe(shape="qwen3-moe-tiny", out_dir=MOE_MODEL_DIR, sft=SFTConfig(seed=0)),
    # The tool task (lorarl.assets.tool_task): the dense shape, whole conversations with the calculator.
    "tools": TinyRecipe(shape="qwen3-tiny", out_dir=TOOLS_MODEL_DIR,
                        sft=SFTConfig(seed=0, steps=1500, clean_steps=600, slip_rate=0.7)),
    # Both: the tool policy taught the single-turn tasks beside its own (alternate batches, MixedTeacher), so
    # the arithmetic demo and the tool agent can share one base (examples/multitenant).
    "mixed": TinyRecipe(shape="qwen3-tiny", out_dir=MIXED_MODEL_DIR, start_from=TOOLS_MODEL_DIR,
                        sft=SFTConfig(seed=0, steps=1600, clean_steps=800, slip_rate=0.7)),
}


def build_tiny_model(recipe: TinyRecipe) -> dict[str, Any]:
    """Pretrain one tiny policy, save it with the tokenizer, measure it; returns build_info."""
    from lorarl.assets.models import count_parameters, save_model, shape_config
    from lorarl.assets.pretrain import pretrain
    from lorarl.assets.tasks import load_split

    def log(message: str) -> None:
        print(f"[{recipe.shape}] {message}", flush=True)

    start = time.monotonic()
    if recipe.out_dir == TOOLS_MODEL_DIR:
        return build_tool_model(recipe, log, start)
    if recipe.out_dir == MIXED_MODEL_DIR:
        return build_mixed_model(recipe, log, start)
    model, summary = pretrain(shape_config(recipe.shape), load_split("train"), recipe.sft, log=log)
    save_model(model, recipe.out_dir)
    info = {"shape": recipe.shape, "parameters": count_parameters(model), **summary, **task_figures(model)}
    (recipe.out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(
        f"greedy {info['test_greedy_accuracy']:.3f}, pass@8 {info['test_sampling_t1']['pass@8']:.3f}, built in "
        f"{time.monotonic() - start:.0f}s -> {recipe.out_dir}"
    )
    return info


def task_figures(model: Any) -> dict[str, Any]:
    """A policy's held-out figures on the single-turn tasks: greedy accuracy (all, per task) and pass@8 at T=1."""
    from lorarl.assets.evaluate import evaluate_greedy, pass_at_k

    greedy = evaluate_greedy(model, "test")
    sampled = pass_at_k(model, "test", k=8, temperature=1.0, seed=0)
    return {"test_greedy_accuracy": round(greedy.accuracy, 4),
            "test_greedy_accuracy_per_task": {k: round(v, 4) for k, v in greedy.per_task.items()},
            "test_sampling_t1": {k: round(v, 4) for k, v in sampled.items()}}


def tool_figures(model: Any) -> dict[str, float]:
    """A policy's held-out tool episodes, decoded greedily: success, call rate, success when called."""
    from lorarl.assets.evaluate import evaluate_tool_greedy
    from lorarl.assets.tool_task import load_tool_split

    return {k: round(v, 4) for k, v in evaluate_tool_greedy(model, load_tool_split("test")).items()}


def build_tool_model(recipe: TinyRecipe, log, start: float) -> dict[str, Any]:
    """The tool task's policy: pretrained on its fallible agent's conversations, measured greedily."""
    from lorarl.assets.models import count_parameters, save_model, shape_config
    from lorarl.assets.pretrain import ToolTeacher, pretrain
    from lorarl.assets.tool_task import load_tool_split

    model, summary = pretrain(shape_config(recipe.shape), load_tool_split("train"), recipe.sft, log=log,
                              teacher_class=ToolTeacher)
    save_model(model, recipe.out_dir)
    greedy = tool_figures(model)
    info = {"shape": recipe.shape, "task": "tools", "parameters": count_parameters(model), **summary,
            "test_greedy": greedy}
    (recipe.out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"greedy success {greedy['success']:.3f}, calls {greedy['call_rate']:.3f}, built in "
        f"{time.monotonic() - start:.0f}s -> {recipe.out_dir}")
    return info


def build_mixed_model(recipe: TinyRecipe, log, start: float) -> dict[str, Any]:
    """The shared base of examples/multitenant: warm from the tool policy, taught both kinds of task, measured
    on both (each must leave RL room: a job learns only what its base sometimes gets right)."""
    from transformers import AutoModelForCausalLM

    from lorarl.assets.models import count_parameters, save_model, shape_config
    from lorarl.assets.pretrain import MixedTeacher, pretrain
    from lorarl.assets.tasks import load_split
    from lorarl.assets.tool_task import load_tool_split

    warm = AutoModelForCausalLM.from_pretrained(str(recipe.start_from), dtype="float32")
    problems = [*load_tool_split("train"), *load_split("train")]
    model, summary = pretrain(shape_config(recipe.shape), problems, recipe.sft, log=log, teacher_class=MixedTeacher,
                              start=warm)
    save_model(model, recipe.out_dir)
    info = {"shape": recipe.shape, "task": "tasks+tools", "start_from": recipe.start_from.name,
            "tool_every": MixedTeacher.tool_every, "parameters": count_parameters(model), **summary,
            **task_figures(model), "test_greedy_tools": tool_figures(model)}
    (recipe.out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"tasks greedy {info['test_greedy_accuracy']:.3f} {info['test_greedy_accuracy_per_task']}, tools success "
        f"{info['test_greedy_tools']['success']:.3f}, built in {time.monotonic() - start:.0f}s -> {recipe.out_dir}")
    return info


def build_tiny_models(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Build the named tiny policies; several build at once, each in its own interpreter."""
    if len(names) == 1:
        return {names[0]: build_tiny_model(RECIPES[names[0]])}
    children = {name: subprocess.Popen([sys.executable, "-m", "lorarl.assets.build", "--only", name]) for name in names}
    failed = [name for name, child in children.items() if child.wait() != 0]
    if failed:
        raise RuntimeError(f"building {', '.join(failed)} failed (see the log above)")
    return {name: json.loads((RECIPES[name].out_dir / "build_info.json").read_text()) for name in names}


def build_assets(parts: Sequence[str] = PARTS) -> None:
    """Rebuild the named parts of ``lorarl/assets/`` (models need the tokenizer and tasks on disk)."""
    from lorarl.assets.tasks import write_splits
    from lorarl.assets.tokenizer import save_tokenizer

    start = time.monotonic()
    if "tokenizer" in parts:
        print(f"tokenizer -> {save_tokenizer(TOKENIZER_DIR)}")
    if "tasks" in parts:
        from lorarl.assets.mixed_task import write_splits as write_mixed_splits
        from lorarl.assets.tool_task import write_splits as write_tool_splits

        tasks, tools = write_splits(TASKS_DIR), write_tool_splits()
        for split, path in [*tasks.items(), *tools.items(), *write_mixed_splits().items()]:  # mixed: of the two
            print(f"{split} split -> {path}")
    models = [name for name in RECIPES if name in parts and RECIPES[name].start_from is None]
    if models:
        build_tiny_models(models)
    warm = [name for name in RECIPES if name in parts and RECIPES[name].start_from is not None]
    if warm:  # after the models they start from
        build_tiny_models(warm)
    print(f"built {', '.join(parts)} in {time.monotonic() - start:.0f}s")


def build_shape(args: argparse.Namespace) -> None:
    import torch

    from lorarl.assets.models import build_random_model

    summary = build_random_model(
        args.shape,
        Path(args.out),
        num_layers=args.layers,
        num_experts=args.experts,
        seed=args.seed,
        dtype=getattr(torch, args.dtype),
    )
    print(json.dumps(summary, indent=2))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from lorarl.assets.models import SHAPES

    parser = argparse.ArgumentParser(prog="python -m lorarl.assets.build", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to rebuild")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="build a random-init model of this shape")
    parser.add_argument("--out", help="output directory for --shape")
    parser.add_argument("--layers", type=int, help="number of layers for --shape (default: the real depth)")
    parser.add_argument("--experts", type=int, help="number of experts for an MoE --shape")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weights dtype for --shape")
    parser.add_argument("--seed", type=int, default=0, help="init seed for --shape")
    args = parser.parse_args(argv)
    if args.shape and not args.out:
        parser.error("--shape needs --out")
    if args.out and not args.shape:
        parser.error("--out applies to --shape only")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shape:
        build_shape(args)
    else:
        build_assets(args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
