"""Where a run's numbers go: a JSONL log, TensorBoard events, optional W&B, a progress line,
and at the end a PNG of reward and held-out accuracy over steps plus a short text summary."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from lorarl.client.rl import metric_names as names
from lorarl.client.rl.progress import ProgressBar


def wandb_init(cfg) -> dict[str, Any]:
    """wandb.init's keywords from the job file (output.wandb_*): the run takes the job's name unless the file gives
    one, so a project's runs read as the jobs they are rather than W&B's generated names."""
    o = cfg.output
    return {"project": o.wandb_project, "name": o.wandb_run or cfg.job_id,
            **({"entity": o.wandb_entity} if o.wandb_entity else {}),
            **({"tags": list(o.wandb_tags)} if o.wandb_tags else {})}


def finite(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with NaN and infinities as None: metrics.jsonl stays JSON that any parser reads."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


class RunLog:
    """Appends metric dicts (each with a ``step``) to every configured sink."""

    def __init__(self, out_dir: Path, *, total_steps: int, tensorboard: bool = True, wandb: bool = False,
                 progress: bool = True, config: dict[str, Any] | None = None,
                 wandb_settings: dict[str, Any] | None = None, wandb_module: Any = None,
                 success_reward: float = 1.0) -> None:
        """``wandb_settings``: wandb.init's keywords (``wandb_init``; project "lorarl" unless they name one).
        ``wandb_module``: what stands for the ``wandb`` package (None: import it), the seam a test records through
        without an account or the package. ``success_reward``: loop.success_reward, said wherever accuracy is."""
        self.out_dir = out_dir
        self.success_reward = success_reward
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = out_dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a")
        self.total_steps = total_steps
        self.progress = ProgressBar(total_steps, success_reward=success_reward) if progress else None
        self.rows: list[dict[str, float]] = []
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            except ImportError:
                self._tb = None
        self._wandb = None
        if wandb:
            if wandb_module is None:
                try:
                    import wandb as wandb_module
                except ImportError:
                    print("wandb is not installed; skipping Weights & Biases logging", file=sys.stderr)
            if wandb_module is not None:
                self._wandb = wandb_module.init(**{"project": "lorarl", **(wandb_settings or {})},
                                                config=config or {}, dir=str(out_dir))

    def __call__(self, metrics: dict[str, float]) -> None:
        row = {"wall_time": time.time(), **metrics}
        self.rows.append(row)
        self._jsonl.write(json.dumps(finite(row), allow_nan=False) + "\n")
        self._jsonl.flush()
        step = int(metrics.get("step", 0))
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self.progress is not None:
            self.progress.update(metrics)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A few of a step's samples to read (prompt, completion, reward): samples.jsonl, and TensorBoard text."""
        with (self.out_dir / "samples.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, default=str) + "\n")
        if self._tb is not None:
            text = "\n\n".join(f"**reward {row['reward']:.3f}**{' (cut at max_tokens)' if row.get('truncated') else ''}"
                                f"\n\n    {row['prompt']}\n\n    -> {row['completion']}" for row in rows)
            self._tb.add_text("rollout/samples", text, step)
            self._tb.flush()

    def rewind(self, step: int) -> None:
        """Forgets every row past ``step`` (a run carrying on from a resume point redoes those steps), in
        metrics.jsonl too, which then holds this run's rows from its first invocation on, each step once."""
        kept = []
        if self.jsonl_path.exists():
            for line in self.jsonl_path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if isinstance(row, dict) and row.get("step", 0) <= step:
                    kept.append({k: math.nan if v is None else v for k, v in row.items()})
        self._jsonl.close()
        tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(finite(row), allow_nan=False) + "\n" for row in kept))
        tmp.replace(self.jsonl_path)
        self._jsonl = self.jsonl_path.open("a")
        self.rows = kept

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    # ------------------------------------------------------------------ end of run

    def evals(self) -> list[dict[str, float]]:
        return [r for r in self.rows if names.EVAL_ACCURACY in r]

    def plot(self, path: Path | None = None) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = path or self.out_dir / "learning_curve.png"
        steps = [r for r in self.rows if names.REWARD_MEAN in r]
        evals = self.evals()
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        ax.plot([r["step"] for r in steps], [r[names.REWARD_MEAN] for r in steps], label="train reward (mean)",
                color="tab:blue", alpha=0.8)
        ax.plot([r["step"] for r in evals], [r[names.EVAL_ACCURACY] for r in evals], "o-",
                label=f"held-out accuracy (reward >= {self.success_reward:g})", color="tab:orange")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title("lorarl: reward and held-out greedy accuracy")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def summary(self) -> str:
        evals = self.evals()
        if not evals:
            return "no evaluation recorded"
        first, last = evals[0], evals[-1]
        steps = [r for r in self.rows if names.REWARD_MEAN in r]
        lags = [r.get(names.VERSION_LAG, 0) for r in steps]
        accuracy, mean_reward = names.EVAL_ACCURACY, names.EVAL_MEAN_REWARD
        lines = [
            f"held-out greedy accuracy: {first[accuracy]:.3f} -> {last[accuracy]:.3f} "
            f"({100 * (last[accuracy] - first[accuracy]):+.1f} points), counting reward >= {self.success_reward:g} "
            "as a success",
            f"held-out mean reward:     {first[mean_reward]:.3f} -> {last[mean_reward]:.3f}",
            f"steps: {len(steps)}, wall time: {last.get('time_s', 0):.0f} s, max policy version lag: "
            f"{int(max(lags, default=0))}",
        ]
        return "\n".join(lines)
