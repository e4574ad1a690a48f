"""An RL loop in the Tinker cookbook's style, on the official `tinker` client only: sample a group per
prompt, reward it, centre the rewards into advantages, train with the `importance_sampling` loss, step,
and sample again from the new weights. lorarl's Tinker front serves the calls.

    lorarl tinker examples/demo.yaml loop.mode=sync      # the services and the front; prints the two exports
    export TINKER_BASE_URL=... TINKER_API_KEY=...
    python examples/tinker/rl_loop.py [STEPS]

The task is the demo's (the shipped tiny Qwen3, its arithmetic and digit-sorting problems); the client
renders the chat prompt with the model's own tokenizer and scores the decoded answers itself.
"""

from __future__ import annotations

import os
import random
import sys
import time

import tinker
from tinker import types

from lorarl.assets.tasks import REWARD_FNS, load_split

BASE_MODEL = os.environ.get("TINKER_BASE_MODEL", "qwen3-tiny")
PROMPTS, GROUP, MAX_TOKENS, LEARNING_RATE = 16, 8, 8, 2e-3
EVAL_PROBLEMS = int(os.environ.get("EVAL_PROBLEMS", "100"))
reward = REWARD_FNS["exact"]


def prompt_tokens(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def accuracy(sampler: tinker.SamplingClient, tokenizer, problems: list) -> float:
    greedy = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, p.prompt)), 1, greedy)
               for p in problems]
    right = sum(reward(tokenizer.decode(f.result().sequences[0].tokens), p.answer) >= 1.0
                for f, p in zip(futures, problems, strict=True))
    return right / len(problems)


def datums(tokens: list[int], sequence: types.SampledSequence, advantage: float) -> types.Datum:
    """One sample as the loss reads it: every position predicts the next token; only the sampled ones count."""
    full = tokens + list(sequence.tokens)
    prompt_positions = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=full[1:], dtype="int64"),
            "logprobs": types.TensorData(data=[0.0] * prompt_positions + list(sequence.logprobs), dtype="float32"),
            "advantages": types.TensorData(data=[0.0] * prompt_positions + [advantage] * len(sequence.tokens),
                                           dtype="float32"),
        })


def main(steps: int = 20) -> int:
    train, test = load_split("train"), load_split("test")[:EVAL_PROBLEMS]
    order = random.Random(0)
    started = time.perf_counter()
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    before = accuracy(sampler, tokenizer, test)
    print(f"held-out greedy accuracy before: {before:.3f}", flush=True)
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    for step in range(steps):
        problems = order.sample(train, PROMPTS)
        prompts = [prompt_tokens(tokenizer, p.prompt) for p in problems]
        futures = [sampler.sample(types.ModelInput.from_ints(t), GROUP, params) for t in prompts]
        batch, rewards = [], []
        for problem, tokens, future in zip(problems, prompts, futures, strict=True):
            sequences = future.result().sequences
            scores = [reward(tokenizer.decode(s.tokens), problem.answer) for s in sequences]
            mean = sum(scores) / len(scores)
            rewards += scores
            batch += [datums(tokens, s, r - mean) for s, r in zip(sequences, scores, strict=True)
                      if r != mean and s.tokens]
        if batch:
            result = training.forward_backward(batch, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
            loss = result.result().metrics["loss:sum"]
        else:
            loss = 0.0
        sampler = training.save_weights_and_get_sampling_client().result()
        print(f"step {step + 1}/{steps}  reward {sum(rewards) / len(rewards):.3f}  datums {len(batch)}  "
              f"loss {loss:+.3f}", flush=True)
    after = accuracy(sampler, tokenizer, test)
    print(f"held-out greedy accuracy after:  {after:.3f} ({100 * (after - before):+.1f} points, "
          f"{time.perf_counter() - started:.0f} s)", flush=True)
    service.close("success")  # ends the session: the front frees its job on the trainer and its adapters
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
