"""A hand-written RL loop over lorarl's Python SDK (Tinker-style): sample, score, compute GRPO gradients,
step, publish, repeat; the services do the work, this page is the algorithm.

    .venv/bin/python examples/sdk/finetune.py [STEPS]

Starts the demo job's three services on this machine (lorarl.client.sdk.local_services), trains the
shipped tiny Qwen3's LoRA adapter on the shipped tasks, and prints the held-out greedy accuracy before
and after. `lorarl run examples/demo.yaml` runs the same job with the library's own loop.
"""

from __future__ import annotations

import random
import sys
import time

from lorarl.assets.tasks import REWARD_FNS, load_split
from lorarl.client.sdk import SamplingClient, local_services

JOB = "examples/demo.yaml"
SETTINGS = ["job_id=sdk-finetune", "output.dir=runs/sdk-finetune", "loop.mode=sync"]
PROMPTS, GROUP, MAX_TOKENS = 16, 8, 8
reward = REWARD_FNS["exact"]


def accuracy(sampler: SamplingClient, problems: list) -> float:
    right = 0
    for problem in problems:
        _, (completion,) = sampler.sample(problem.prompt, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
        right += reward(completion.text, problem.answer) >= 1.0
    return right / len(problems)


def main(steps: int = 30) -> int:
    train, test = load_split("train"), load_split("test")
    order = random.Random(0)
    started = time.perf_counter()
    with local_services(JOB, SETTINGS) as services:
        trainer = services.training_client(JOB, SETTINGS)
        base = services.sampling_client()  # version 0 is the base model (a fresh adapter is the identity)
        before = accuracy(base, test)
        print(f"held-out greedy accuracy before: {before:.3f}", flush=True)
        sampler = base
        for step in range(steps):
            batch = []
            for index, problem in enumerate(order.sample(train, PROMPTS)):
                prompt, samples = sampler.sample(problem.prompt, n=GROUP, temperature=1.0, max_tokens=MAX_TOKENS,
                                                 seed=step * 1000 + index)
                batch += [{"prompt_ids": prompt, "completion_ids": s.token_ids, "logprobs": s.logprobs,
                           "versions": s.versions, "reward": reward(s.text, problem.answer),
                           "group_id": f"s{step}-p{index}"} for s in samples if s.token_ids]
            metrics = trainer.forward_backward(batch)  # the job's loss: GRPO over each prompt's group
            trainer.optim_step()
            trainer.publish()  # the rollout serves the new version before the next samples
            sampler = services.sampling_client(trainer.job_id)
            mean = sum(item["reward"] for item in batch) / len(batch)
            print(f"step {step + 1}/{steps}  reward {mean:.3f}  loss {metrics['loss']:+.4f}  "
                  f"v{trainer.version}", flush=True)
        after = accuracy(sampler, test)
        print(f"held-out greedy accuracy after:  {after:.3f} ({100 * (after - before):+.1f} points, "
              f"{time.perf_counter() - started:.0f} s)", flush=True)
        print(f"adapter (PEFT): {trainer.export()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 30))
