"""The peer: TRL's GRPOTrainer with a PEFT LoRA adapter and HF generate on CPU, on a lorarl job's settings.

Run as its own process by bench/trl_vs_lorarl.py (``python bench/trl_grpo.py SPEC.json RESULT.json``) so
it gets the machine's cores to itself (torch threads = ``spec["threads"]``) while lorarl's services are
down. The spec carries the lorarl job's settings and the exact prompts lorarl trained on, in order;
the trainer sees them unshuffled, 16 prompts x 8 samples per optimizer step, one step per generation.
Every ``export_every`` steps the adapter is saved (PEFT format) for the shared evaluator; training time
excludes those saves. Requires ``make bench-setup`` (trl, datasets).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def grpo_config_kwargs(spec: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """GRPOConfig arguments matching the lorarl job (see UNMATCHED for what cannot match)."""
    group, prompts = spec["group_size"], spec["prompts_per_step"]
    return dict(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, seed=spec["seed"],
        max_steps=spec["steps"], per_device_train_batch_size=group * prompts, gradient_accumulation_steps=1,
        num_generations=group, num_iterations=1, shuffle_dataset=False,
        max_completion_length=spec["max_tokens"], temperature=spec["temperature"], top_p=spec["top_p"], top_k=0,
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=spec["weight_decay"], max_grad_norm=spec["max_grad_norm"] or 1e9,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
        loss_type=spec["loss_type"], scale_rewards="group", beta=spec["kl_coef"],
        epsilon=spec["clip_eps_low"], epsilon_high=spec["clip_eps_high"],
        gradient_checkpointing=False, disable_dropout=True, use_vllm=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )


UNMATCHED = [
    "generation: HF generate in the trainer process (TRL without vLLM) vs lorarl's vLLM rollout service",
    "advantage: TRL divides by (group std + 1e-4), lorarl by (group std + 1e-6); both unbiased std",
    "ratio: TRL with num_iterations=1 takes the ratio against its own detached logprobs (exactly 1), "
    "lorarl against the sampler's logprobs (equal up to float noise in sync mode; up to loop.max_staleness "
    "versions behind in async, with the decoupled loss)",
    "sampling seeds: both seeded, but the random streams differ (HF vs vLLM samplers)",
    "LoRA init: PEFT's and lorarl's own initialisation draw different A matrices (B = 0 in both)",
]


def train(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lorarl.client.job.rewards import load_reward

    reward_fn = load_reward(spec["reward"])

    def reward(completions: list, answer: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward_fn(t, a)) for t, a in zip(texts, answer, strict=True)]

    reward.__name__ = spec["reward"]
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": a} for p, a in spec["examples"]]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    targets = spec["target_modules"]
    lora = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"], bias="none",
                      target_modules="all-linear" if targets == ["all-linear"] else targets, task_type="CAUSAL_LM")
    args = GRPOConfig(**grpo_config_kwargs(spec, str(out_dir / "trainer")))
    clock = _Clock(out_dir, spec["export_every"], spec["steps"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[clock.callback(TrainerCallback)])
    clock.startup_s = time.perf_counter() - started
    trainer.train()
    clock.finish(trainer.model)
    return {"startup_s": clock.startup_s, "train_s": clock.train_s, "train_s_at_step": clock.at_step,
            "adapters": clock.adapters, "export_s": clock.export_s, "log": trainer.state.log_history,
            "threads": torch.get_num_threads()}


class _Clock:
    """Training seconds at each step's end, from the first step's start, minus adapter saves."""

    def __init__(self, out_dir: Path, export_every: int, steps: int) -> None:
        self.out_dir, self.export_every, self.steps = out_dir, export_every, steps
        self.startup_s = self.export_s = self.train_s = 0.0
        self.started = 0.0
        self.at_step: dict[int, float] = {}
        self.adapters: dict[int, str] = {}

    def save(self, model: Any, step: int) -> None:
        if step in self.adapters:
            return
        t0 = time.perf_counter()
        path = self.out_dir / "adapters" / f"step-{step:06d}"
        model.save_pretrained(str(path))
        self.adapters[step] = str(path)
        self.export_s += time.perf_counter() - t0

    def finish(self, model: Any) -> None:
        self.save(model, max(self.at_step, default=0))

    def callback(self, base: type) -> Any:
        clock = self

        class Callback(base):  # type: ignore[misc, valid-type]
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                clock.started = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                step = state.global_step
                clock.train_s = time.perf_counter() - clock.started - clock.export_s
                clock.at_step[step] = clock.train_s
                if clock.export_every and (step % clock.export_every == 0 or step == clock.steps):
                    clock.save(model, step)

        return Callback()


def main() -> int:
    spec_path, result_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    result = train(spec, result_path.parent)
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
