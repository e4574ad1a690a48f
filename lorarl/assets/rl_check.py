"""Evidence that a shipped policy leaves room for RL: a minimal GRPO + LoRA loop in plain transformers.

This is no trainer: it has no services, no vLLM and no off-policy correction. It exists so a change to
the assets can be checked against the property the project relies on, namely that a short GRPO run
with LoRA lifts held-out greedy accuracy by tens of points on CPU:

    python -m lorarl.assets.rl_check --model lorarl/assets/models/qwen3-tiny --minutes 5
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorarl.assets.evaluate import evaluate_greedy, generate_token_ids
from lorarl.assets.paths import DENSE_MODEL_DIR
from lorarl.assets.tasks import exact_reward, load_split
from lorarl.assets.tokenizer import default_tokenizer, prompt_token_ids
from lorarl.contract.lora import DENSE_TARGETS


@dataclass(frozen=True)
class GRPOConfig:
    """One GRPO step: ``prompts`` problems x ``group`` samples at ``temperature``, one on-policy update."""

    seed: int = 0
    prompts: int = 16
    group: int = 8
    temperature: float = 1.0
    lr: float = 2e-3
    lora_rank: int = 8
    lora_alpha: int = 16
    eval_every: int = 10
    threads: int = 1


def _sequence_logprobs(model: Any, rows: Sequence[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per-token log-probs of each completion given its prompt (right-padded batch)."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, : len(p) + len(c)] = 1
    logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    out = []
    for i, (p, c) in enumerate(rows):
        positions = torch.arange(len(p) - 1, len(p) + len(c) - 1)
        out.append(logprobs[i, positions, torch.tensor(c)])
    return out


def run(model_dir: Path, minutes: float, cfg: GRPOConfig = GRPOConfig()) -> list[dict[str, float]]:
    """Train a LoRA with GRPO for ``minutes``; returns the greedy test accuracy history."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = default_tokenizer()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(DENSE_TARGETS), lora_dropout=0.0)
    model = get_peft_model(base, lora)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    train, test = load_split("train"), load_split("test")
    start = time.monotonic()
    history = [{"step": 0, "seconds": 0.0, "greedy": evaluate_greedy(model, test).accuracy, "reward": 0.0}]
    print(f"step 0 greedy {history[0]['greedy']:.3f}")
    step = 0
    while time.monotonic() - start < minutes * 60:
        step += 1
        batch = rng.sample(train, cfg.prompts)
        prompt_ids = [prompt_token_ids(tokenizer, p.prompt) for p in batch for _ in range(cfg.group)]
        model.eval()
        completions = generate_token_ids(model, prompt_ids, temperature=cfg.temperature, seed=rng.randrange(2**31))
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        rewards = torch.tensor([exact_reward(t, batch[i // cfg.group].answer) for i, t in enumerate(texts)])
        grouped = rewards.view(cfg.prompts, cfg.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        keep = [i for i in range(len(texts)) if advantages[i] != 0 and completions[i]]
        if keep:
            model.train()
            logprobs = _sequence_logprobs(model, [(prompt_ids[i], completions[i]) for i in keep])
            loss = -sum(advantages[i] * lp.mean() for i, lp in zip(keep, logprobs, strict=True)) / len(texts)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if step % cfg.eval_every == 0:
            model.eval()
            greedy = evaluate_greedy(model, test).accuracy
            seconds = time.monotonic() - start
            history.append({"step": step, "seconds": seconds, "greedy": greedy, "reward": rewards.mean().item()})
            print(f"step {step} ({seconds:.0f}s) train reward {rewards.mean():.3f} greedy {greedy:.3f}")
    return history


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorarl.assets.rl_check", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DENSE_MODEL_DIR)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    history = run(args.model, args.minutes, GRPOConfig(threads=args.threads))
    best = max(h["greedy"] for h in history)
    print(f"greedy {history[0]['greedy']:.3f} -> {history[-1]['greedy']:.3f} (best {best:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
