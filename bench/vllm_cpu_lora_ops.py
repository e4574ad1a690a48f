"""CPU LoRA application in vLLM: the current fixes (grouped bgmv ops) vs the fixes + the lean path.

One offline ``LLM`` in this process (the demo shape: qwen3-tiny fp32, a rank-8 all-linear adapter,
16 prompts of 14-18 tokens x 8 seeded samples, 8 new tokens with ignore_eos). Rounds alternate the
two settings (switched with ``lorarl_install_cpu_fixes(lean_lora=...)`` on the same engine, so both
see the same machine load), plus the base model as a yardstick. Per setting: a full batch, and a
prefill-only batch (max_tokens=1); a decode step is (full - prefill) / 7. Sampled tokens must be
identical across settings. Prints medians and bests, and the lean/current ratio.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/vllm_cpu_lora_ops.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_ADAPTER = ROOT / "runs/bench-trl-vs-lorarl/lorarl/exports/bench-lorarl/step-000040"
MAX_TOKENS = 8


def _adapter_dir(path: Path, model_dir: Path) -> Path:
    """The given PEFT adapter, or (when absent) a random rank-8 all-linear one saved to a temp dir."""
    if (path / "adapter_config.json").is_file():
        return path
    import json

    from safetensors.torch import save_file

    from tests.unit.rollout.models import ALL_LINEAR, random_adapter

    out = Path(tempfile.mkdtemp(prefix="lorarl-bench-adapter-"))
    save_file(random_adapter(model_dir, rank=8, seed=1), str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": list(ALL_LINEAR), "bias": "none"}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--adapter", type=Path, default=DEFAULT_ADAPTER)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()
    for name, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
        os.environ.setdefault(name, value)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from lorarl.assets.paths import DENSE_MODEL_DIR
    from lorarl.rollout.vllm.worker_ext import EXTENSION_QUALNAME

    llm = LLM(model=str(DENSE_MODEL_DIR), dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
              max_num_seqs=args.prompts * args.n, enable_lora=True, max_lora_rank=8, max_loras=2,
              worker_extension_cls=EXTENSION_QUALNAME, disable_log_stats=True)
    lora = LoRARequest("bench", 1, str(_adapter_dir(args.adapter, DENSE_MODEL_DIR)))
    prompts = [TokensPrompt(prompt_token_ids=[(11 * p + 5 * i) % 250 + 1 for i in range(14 + p % 5)])
               for p in range(args.prompts)]

    def batch(max_tokens: int, request: Any) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(n=args.n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=100 + p)
                  for p in range(args.prompts)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, [list(c.token_ids) for o in outputs for c in o.outputs]

    settings = {"current": (False, lora), "lean": (True, lora), "base": (True, None)}
    times: dict[str, dict[str, list[float]]] = {name: {"batch": [], "prefill": []} for name in settings}
    tokens: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        order = list(settings) if round_ % 2 else list(reversed(settings))
        for name in order:
            lean, request = settings[name]
            llm.collective_rpc("lorarl_install_cpu_fixes", kwargs={"lean_lora": lean})
            prefill, _ = batch(1, request)
            full, out = batch(MAX_TOKENS, request)
            assert all(len(t) == MAX_TOKENS for t in out)
            if tokens.setdefault(name, out) != out:
                raise AssertionError(f"{name}: seeded tokens changed between rounds")
            if round_:
                times[name]["prefill"].append(prefill)
                times[name]["batch"].append(full)
    if tokens["lean"] != tokens["current"]:
        raise AssertionError("the lean path sampled other tokens than the current fixes")

    def step_ms(name: str, pick: Any) -> float:
        return 1e3 * (pick(times[name]["batch"]) - pick(times[name]["prefill"])) / (MAX_TOKENS - 1)

    print(f"{args.prompts} prompts x n={args.n}, {MAX_TOKENS} new tokens, {args.rounds} rounds "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    print(f"{'setting':<8} {'batch median':>13} {'batch best':>11} {'decode step median':>19} {'best':>8}")
    for name in settings:
        batch_times = times[name]["batch"]
        print(f"{name:<8} {1e3 * statistics.median(batch_times):>10.1f} ms {1e3 * min(batch_times):>8.1f} ms "
              f"{step_ms(name, statistics.median):>16.2f} ms {step_ms(name, min):>5.2f} ms")
    ratio = statistics.median(times["lean"]["batch"]) / statistics.median(times["current"]["batch"])
    step_ratio = step_ms("lean", statistics.median) / step_ms("current", statistics.median)
    print(f"lean / current: batch {ratio:.2f}x, decode step {step_ratio:.2f}x (median); "
          f"seeded tokens identical: {tokens['lean'] == tokens['current']}")


if __name__ == "__main__":
    main()
