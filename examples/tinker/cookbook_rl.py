"""Thinking Machines' tinker-cookbook RL loop, unchanged (`tinker_cookbook.rl.train.main`), on lorarl's Tinker
front: the cookbook's own sampling, group advantages, `importance_sampling` loss, Adam steps and checkpoints
("final": state and sampler weights), on the demo's task (examples/tinker/cookbook_task.py).

    lorarl tinker examples/demo.yaml loop.mode=sync      # the services and the front; prints the two exports
    export TINKER_BASE_URL=... TINKER_API_KEY=...
    python examples/tinker/cookbook_rl.py [STEPS]

Prints the held-out greedy accuracy before (the base) and after (the cookbook's final sampler path).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import tinker
from cookbook_task import BASE_MODEL, MAX_TOKENS, RENDERER, TaskDatasetBuilder, accuracy, register, report_after
from tinker_cookbook.rl import train

LEARNING_RATE = 2e-3


def main(steps: int = 24) -> int:
    renderer = register()
    log_path = tempfile.mkdtemp(prefix="cookbook-rl-")
    with tinker.ServiceClient() as service:
        before = accuracy(service.create_sampling_client(base_model=BASE_MODEL).result(), renderer)
    print(f"held-out greedy accuracy before: {before:.3f}", flush=True)
    config = train.Config(learning_rate=LEARNING_RATE, model_name=BASE_MODEL, recipe_name="lorarl_demo",
                          dataset_builder=TaskDatasetBuilder(model_name=BASE_MODEL, steps=steps),
                          max_tokens=MAX_TOKENS, log_path=log_path, eval_every=0, save_every=0,
                          renderer_name=RENDERER, base_url=os.environ.get("TINKER_BASE_URL"))
    asyncio.run(train.main(config))
    report_after(log_path, renderer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*map(int, sys.argv[1:])))
