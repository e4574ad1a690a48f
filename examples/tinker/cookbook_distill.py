"""Thinking Machines' tinker-cookbook on-policy distillation, unchanged
(`tinker_cookbook.distillation.train_on_policy.main`), on lorarl's Tinker front, with the teacher a LoRA
adapter on the student's own base: the student samples, the teacher's sampling client scores the student's
tokens (on the front's one rollout engine), and the cookbook trains on the per-token reverse KL.

    lorarl tinker examples/demo.yaml loop.mode=sync      # the services and the front; prints the two exports
    export TINKER_BASE_URL=... TINKER_API_KEY=...
    python examples/tinker/cookbook_distill.py [STEPS]

The teacher is taught first, through the same front: the demo's answers by cross-entropy (TEACHER_STEPS steps of
16 problems), saved for sampling by name. The distillation data are the cookbook's own prompt-only dataset (no
reward: only the teacher's log-probabilities teach). Prints the held-out greedy accuracy of the base, the teacher
and the distilled student.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import chz
import tinker
from cookbook_task import BASE_MODEL, GROUP_SIZE, GROUPS, MAX_TOKENS, RENDERER, accuracy, register, report_after
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from lorarl.assets.tasks import load_split

LEARNING_RATE, TEACHER_STEPS, TEACHER_RANK = 2e-3, 12, 8


@chz.chz
class TaskPrompts(RLDatasetBuilder):
    """The demo's training prompts (text only) as the cookbook's PromptOnlyDataset."""

    model_name: str
    steps: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        tokenizer = get_tokenizer(self.model_name)
        renderer = renderers.get_renderer(RENDERER, tokenizer)
        prompts = [p.prompt for p in load_split("train")[:self.steps * GROUPS]]
        return PromptOnlyDataset(prompts, GROUPS, GROUP_SIZE, renderer, tokenizer, dataset_name="demo"), None


def teach(service: tinker.ServiceClient, renderer: renderers.Renderer) -> str:
    """A teacher adapter taught the answers by cross-entropy; its sampler path."""
    teacher = service.create_lora_training_client(base_model=BASE_MODEL, rank=TEACHER_RANK)
    problems = load_split("train")[:GROUPS * TEACHER_STEPS]
    for step in range(TEACHER_STEPS):
        batch = []
        for p in problems[GROUPS * step:GROUPS * (step + 1)]:
            prompt = renderer.build_generation_prompt([{"role": "user", "content": p.prompt}]).to_ints()
            answer = [*renderer.tokenizer.encode(p.answer, add_special_tokens=False),
                      *renderer.get_stop_sequences()]
            full = prompt + answer
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
            batch.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": types.TensorData(data=full[1:], dtype="int64"),
                "weights": types.TensorData(data=weights, dtype="float32")}))
        teacher.forward_backward(batch, "cross_entropy").result()
        teacher.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return teacher.save_weights_for_sampler(name="teacher").result().path


def main(steps: int = 10) -> int:
    renderer = register()
    log_path = tempfile.mkdtemp(prefix="cookbook-distill-")
    with tinker.ServiceClient() as service:
        before = accuracy(service.create_sampling_client(base_model=BASE_MODEL).result(), renderer)
        teacher_path = teach(service, renderer)
        taught = accuracy(service.create_sampling_client(model_path=teacher_path).result(), renderer)
    print(f"held-out greedy accuracy before: {before:.3f}", flush=True)
    print(f"teacher accuracy: {taught:.3f} ({teacher_path})", flush=True)
    config = train_on_policy.Config(
        learning_rate=LEARNING_RATE, model_name=BASE_MODEL, recipe_name="lorarl_demo_distillation",
        dataset_configs=[DistillationDatasetConfig(
            dataset_builder=TaskPrompts(model_name=BASE_MODEL, steps=steps), groups_per_batch=GROUPS,
            teacher_config=TeacherConfig(base_model=BASE_MODEL, load_checkpoint_path=teacher_path))],
        renderer_name=RENDERER, max_tokens=MAX_TOKENS, log_path=log_path, eval_every=0, save_every=0,
        base_url=os.environ.get("TINKER_BASE_URL"))
    asyncio.run(train_on_policy.main(config))
    report_after(log_path, renderer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*map(int, sys.argv[1:])))
