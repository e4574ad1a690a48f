"""The demo's task for tinker-cookbook's loops (examples/tinker/cookbook_rl.py, cookbook_distill.py): what any
cookbook user writes for a new task and a model the cookbook does not know. An environment (`TaskEnv`, a
`ProblemEnv` scoring the demo's arithmetic and digit-sorting answers), its dataset, the tokenizer of the front's
base model registered under the model's name (the cookbook otherwise looks the name up on the Hub), and the
held-out greedy accuracy of a sampling client.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import chz
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer

from lorarl.assets.tasks import REWARD_FNS, Problem, load_split

BASE_MODEL = os.environ.get("TINKER_BASE_MODEL", "qwen3-tiny")
MODEL_DIR = Path(__file__).resolve().parents[2] / "lorarl/assets/models/qwen3-tiny"
RENDERER = "qwen3_instruct"  # the tiny Qwen3's own chat template, token for token
GROUPS, GROUP_SIZE, MAX_TOKENS = 16, 8, 8
EVAL_PROBLEMS = int(os.environ.get("EVAL_PROBLEMS", "100"))
reward = REWARD_FNS["exact"]


def register() -> renderers.Renderer:
    """The base model's tokenizer under its front name (from the shipped folder), and the renderer for it."""
    from transformers import AutoTokenizer

    register_tokenizer(BASE_MODEL, lambda: AutoTokenizer.from_pretrained(MODEL_DIR))
    return renderers.get_renderer(RENDERER, get_tokenizer(BASE_MODEL))


class TaskEnv(ProblemEnv):
    """One demo problem: reward 1 for the exact answer (no format term: the answer is the whole reply)."""

    def __init__(self, renderer: renderers.Renderer, problem: Problem) -> None:
        super().__init__(renderer, format_coef=0.0)
        self.problem = problem

    def get_question(self) -> str:
        return self.problem.prompt

    def check_answer(self, sample_str: str) -> bool:
        return reward(sample_str, self.problem.answer) >= 1.0

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return self.problem.answer


class TaskDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, problems: Sequence[Problem]) -> None:
        self.renderer, self.problems = renderer, list(problems)

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        batch = self.problems[index * GROUPS:(index + 1) * GROUPS]
        return [ProblemGroupBuilder(env_thunk=partial(TaskEnv, self.renderer, p), num_envs=GROUP_SIZE,
                                    dataset_name="demo") for p in batch]

    def __len__(self) -> int:
        return len(self.problems) // GROUPS


@chz.chz
class TaskDatasetBuilder(RLDatasetBuilder):
    """The demo's training problems, GROUPS a batch, for ``steps`` batches."""

    model_name: str
    steps: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name))
        return TaskDataset(renderer, load_split("train")[:self.steps * GROUPS]), None


def accuracy(sampler: tinker.SamplingClient, renderer: renderers.Renderer,
             problems: Sequence[Problem] | None = None) -> float:
    """Greedy exact-answer accuracy on the held-out problems (the first EVAL_PROBLEMS of the test split)."""
    problems = load_split("test")[:EVAL_PROBLEMS] if problems is None else problems
    greedy = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=renderer.get_stop_sequences())
    futures = [sampler.sample(renderer.build_generation_prompt([{"role": "user", "content": p.prompt}]), 1, greedy)
               for p in problems]
    replies = [renderers.get_text_content(renderer.parse_response(f.result().sequences[0].tokens)[0])
               for f in futures]
    return sum(reward(text, p.answer) >= 1.0 for text, p in zip(replies, problems, strict=True)) / len(problems)


def report_after(log_path: str, renderer: renderers.Renderer) -> None:
    """Prints the held-out accuracy of the cookbook's last checkpoint ("final": its sampler path, from the run's
    checkpoints.jsonl)."""
    import json

    records = [json.loads(line) for line in (Path(log_path) / "checkpoints.jsonl").read_text().splitlines()]
    path = records[-1]["sampler_path"]
    with tinker.ServiceClient() as service:
        after = accuracy(service.create_sampling_client(model_path=path).result(), renderer)
    print(f"held-out greedy accuracy after:  {after:.3f} ({path})", flush=True)
