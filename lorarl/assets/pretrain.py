"""Short, seeded SFT that turns a random-init tiny Qwen3 into a base policy with room for RL.

Two phases. First ``clean_steps`` on gold answers only, so the policy learns the right procedures
(clean labels learn several times faster than noisy ones). Then the policy imitates a *fallible
teacher*: each example gets the gold answer, or with probability ``slip_rate`` its task's
characteristic slip (see :mod:`lorarl.assets.tasks`). Where the slip changes the answer the policy ends with
``P(slip) ~ slip_rate > P(gold)``, so greedy decoding is wrong there while sampling still finds the
gold answer often; where the slip is harmless greedy is right. The loss covers the answer tokens and
the end-of-turn token only, so the format (answer, then ``<|im_end|>``) is learnt from every example.

Determinism: one torch thread, seeded init, seeded batch order and seeded teacher coins.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from lorarl.assets.models import init_model
from lorarl.assets.tasks import Problem, task_kind
from lorarl.assets.tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, default_tokenizer, prompt_token_ids

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SFTConfig:
    """Everything that determines a pretraining run (and hence the shipped weights)."""

    seed: int = 0
    steps: int = 1800
    clean_steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    slip_rate: float = 0.7
    threads: int = 1


def encode_problem(tokenizer: Any, problem: Problem, answer: str) -> tuple[list[int], list[int]]:
    """(input ids, labels) for ``chat(prompt) -> answer <|im_end|>``, labels only on the answer part."""
    prompt = prompt_token_ids(tokenizer, problem.prompt)
    target = [*tokenizer.encode(answer, add_special_tokens=False), EOS_TOKEN_ID]
    return prompt + target, [IGNORE_INDEX] * len(prompt) + target


class FallibleTeacher:
    """Serves padded (ids, labels, mask) batches: gold answers, or the slip with probability ``slip_rate``."""

    def __init__(self, problems: Sequence[Problem], tokenizer: Any) -> None:
        self.problems = list(problems)
        self.gold = [encode_problem(tokenizer, p, p.answer) for p in self.problems]
        self.slipped = [encode_problem(tokenizer, p, task_kind(p.task).slip(p.prompt)) for p in self.problems]

    def batch(self, indices: Sequence[int], slip_rate: float, rng: random.Random) -> tuple[torch.Tensor, ...]:
        rows = [self.slipped[i] if rng.random() < slip_rate else self.gold[i] for i in indices]
        return _padded(rows)


class ToolTeacher:
    """The fallible agent of the tool task (lorarl.assets.tool_task): whole conversations rendered by the chat
    template with the calculator tool, labels on the assistant turns (through their ``<|im_end|>``). A slip
    (probability ``slip_rate``) is a skipped call (``skip_share`` of slips) or a misread result."""

    skip_share = 0.35

    def __init__(self, problems: Sequence[Any], tokenizer: Any) -> None:
        from lorarl.assets.tool_task import TOOLS, conversation

        self.problems = list(problems)
        self.encoded = {behaviour: [encode_conversation(tokenizer, conversation(p, behaviour), TOOLS)
                                    for p in self.problems] for behaviour in ("gold", "skip", "misread")}

    def batch(self, indices: Sequence[int], slip_rate: float, rng: random.Random) -> tuple[torch.Tensor, ...]:
        rows = []
        for i in indices:
            coin = rng.random()
            behaviour = "gold" if coin >= slip_rate else "skip" if coin < slip_rate * self.skip_share else "misread"
            rows.append(self.encoded[behaviour][i])
        return _padded(rows)


class MixedTeacher:
    """Both kinds of shipped task for one base (examples/multitenant puts the arithmetic demo and the tool agent
    on one base): tool conversations (ToolTeacher) every ``tool_every``-th call, the single-turn tasks
    (FallibleTeacher) otherwise. Meant for a warm start from the tool policy: it already holds the tool task,
    and the tasks are new. A batch holds one kind so it pads to its own width: a tool conversation is ~10x a
    task's tokens, and mixed batches would cost every step the tool width (~1 s a step here against 0.15 s)."""

    tool_every = 4

    def __init__(self, problems: Sequence[Any], tokenizer: Any) -> None:
        tasks = [p for p in problems if isinstance(p, Problem)]
        self.teachers = (ToolTeacher([p for p in problems if not isinstance(p, Problem)], tokenizer),
                         FallibleTeacher(tasks, tokenizer))
        self.calls = 0

    def batch(self, indices: Sequence[int], slip_rate: float, rng: random.Random) -> tuple[torch.Tensor, ...]:
        teacher = self.teachers[0 if self.calls % self.tool_every == 0 else 1]
        self.calls += 1
        n = len(teacher.problems)
        return teacher.batch([i % n for i in indices], slip_rate, rng)


def encode_conversation(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any
                        ) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a whole chat; labels on each assistant turn's tokens through ``<|im_end|>``
    (the newline the template puts after it is context, as in an episode)."""

    def render(upto: int, opening: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(list(messages[:upto]), tools=tools, add_generation_prompt=opening,
                                            tokenize=True, return_dict=False)
        return [int(i) for i in ids]

    ids = render(len(messages), False)
    labels = [IGNORE_INDEX] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = len(render(i, True)), len(render(i + 1, False))
        labels[start:end] = ids[start:end]
        if ids[end - 1] != EOS_TOKEN_ID:  # the template's newline after <|im_end|>
            labels[end - 1] = IGNORE_INDEX
    return ids, labels


def _padded(rows: Sequence[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, labs) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(labs)] = torch.tensor(labs)
        mask[r, : len(ids)] = 1
    return input_ids, labels, mask


def _lr_factor(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


@contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic kernels for the duration; the caller's settings return after."""
    saved_threads = torch.get_num_threads()
    saved_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        torch.use_deterministic_algorithms(saved_deterministic)


def _optimizer(model: PreTrainedModel, cfg: SFTConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms or biases)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))


def pretrain(
    config: PreTrainedConfig,
    problems: Sequence[Any],
    cfg: SFTConfig = SFTConfig(),
    log: Callable[[str], None] | None = print,
    log_every: int = 100,
    teacher_class: type = FallibleTeacher,
    start: PreTrainedModel | None = None,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Train a fresh model of ``config`` (or ``start``, warm) on ``problems`` (served by ``teacher_class``: the
    single-turn tasks' FallibleTeacher, the tool task's ToolTeacher, or MixedTeacher); returns it (eval mode)
    and a run summary."""
    with deterministic_torch(cfg.threads):
        model = init_model(config, seed=cfg.seed) if start is None else start
        model.train()
        teacher = teacher_class(problems, default_tokenizer())
        optimizer = _optimizer(model, cfg)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, cfg))
        rng = random.Random(cfg.seed)
        order: list[int] = []
        start = time.monotonic()
        losses: list[float] = []
        for step in range(cfg.steps):
            if len(order) < cfg.batch_size:  # epochs in a fresh seeded order
                fresh = list(range(len(problems)))
                rng.shuffle(fresh)
                order += fresh
            indices, order = order[: cfg.batch_size], order[cfg.batch_size :]
            slip_rate = 0.0 if step < cfg.clean_steps else cfg.slip_rate
            input_ids, labels, mask = teacher.batch(indices, slip_rate, rng)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if log and ((step + 1) % log_every == 0 or step + 1 == cfg.steps):
                recent = losses[-log_every:]
                elapsed = time.monotonic() - start
                log(f"step {step + 1}/{cfg.steps} loss {sum(recent) / len(recent):.4f} ({elapsed:.0f}s)")
        model.eval()
    summary = {"sft": asdict(cfg), "final_loss": round(sum(losses[-100:]) / len(losses[-100:]), 4)}
    return model, summary
