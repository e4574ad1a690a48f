"""The Ascend hardware check, ready for one 910B node (minutes): the whole stack on NPUs, adapters and
merged weights over HCCL, trainer/rollout logprob parity after each sync, and a few RL steps.

For each mode — adapter (mode 1) and merged (mode 2) on a random-init model of Qwen3-0.6B's layer
shapes (full vocabulary, --layers decoder layers, bf16), and the headline's shape, `moe-merged-tp2`:
Qwen3-30B-A3B's layer shapes (--layers layers, --experts experts), merged, the rollout on two devices
(tensor parallel 2) with both of its workers receiving each version themselves, one transfer rank each
(rollout.receive_in_worker=on):
1. `lorarl run`'s own stack (trainer on NPU 0, vLLM through vllm-ascend on NPU 1, weight sync over
   hccl), the job's RL loop for --steps steps (each step trains and syncs a new version);
2. then the rollout samples completions with the job's latest version, the trainer scores the same
   tokens (ComputeLogprobs), and the check compares: every token tagged with the trainer's version,
   and the largest |trainer - rollout| logprob under --tolerance.
Prints one table row per mode and exits 1 if any check fails. `--device cpu` runs the same code on
CPU over gloo in fp32 (what CI's smoke test runs, so the script does not rot between hardware sessions).

    python bench/npu_check.py                                 # on the NPU node (ASCEND_RT_VISIBLE_DEVICES=0,1,2)
    python bench/npu_check.py --device cpu --quick            # CPU smoke run: the tiny models' shapes

Expected on a 910B (not run yet: no Ascend hardware has been lent): all three rows `ok`, versions equal to
--steps, max |d logp| of a few hundredths in bf16 (the trainer and vLLM kernels differ in
accumulation order; fp32 on CPU gives ~1e-5), and an adapter effect (mean |policy - base| logprob on those
tokens) above the mean parity gap; the reward is `varied_reward`, since a random-init model solves
nothing and parity must be measured on adapters that training moved.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("adapter", "merged", "moe-merged-tp2")
#: The MoE mode: sync mode, rollout TP and how versions reach the rollout's workers.
MOE_MODE = "moe-merged-tp2"


@dataclass
class ModeResult:
    mode: str
    version: int = 0
    tokens: int = 0
    max_diff: float = math.inf
    mean_diff: float = math.inf
    versions_ok: bool = False
    effect: float = 0.0  # mean |policy - base| logprob: what the trained adapters change
    seconds: float = 0.0
    error: str = ""

    def ok(self, tolerance: float) -> bool:
        return (not self.error and self.versions_ok and self.tokens > 0 and self.max_diff <= tolerance
                and self.effect > self.mean_diff)

    def row(self, tolerance: float) -> str:
        if self.error:
            return f"| {self.mode} | - | - | - | - | - | {self.seconds:.0f} | FAILED: {self.error} |"
        return (f"| {self.mode} | {self.version} | {self.tokens} | {self.max_diff:.2e} | {self.mean_diff:.2e} "
                f"| {self.effect:.2e} | {self.seconds:.0f} | {'ok' if self.ok(tolerance) else 'FAILED'} |")


_REWARDS = random.Random(0)


def varied_reward(completion: str, answer: str) -> float:
    """A random-init model never solves a task (and its tokens beyond the shipped tokenizer's vocabulary
    decode to no text); this reward (seeded noise) still differs between a group's samples, so the
    advantages are not all zero, the adapters move, and parity is measured on trained adapters."""
    return _REWARDS.random()


def job_overrides(mode: str, model_dir: Path, device: str, steps: int, max_tokens: int, out: Path) -> list[str]:
    dtype = "float32" if device == "cpu" else "bfloat16"
    sync = "merged" if mode == MOE_MODE else mode
    # the MoE mode on accelerators: the trainer on device 0, the TP-2 rollout on devices 1-2; LoRA on the experts
    moe = [] if mode != MOE_MODE else [
        "rollout.tensor_parallel_size=2", "rollout.receive_in_worker=on",
        *(["rollout.enforce_eager=true"] if device == "npu" else []),
        *(["placement.nodes=1", "placement.devices_per_node=3"] if device != "cpu" else [])]
    return [f"job_id=npu-check-{mode}", f"model.path={model_dir}", f"model.dtype={dtype}", "data.source=tasks", *moe,
            "data.reward=bench.npu_check:varied_reward", "data.eval_size=4", "rollout.engine=vllm",
            "rollout.group_size=4",
            f"rollout.max_tokens={max_tokens}", f"rollout.eval_max_tokens={max_tokens}", "rollout.kv_cache_gib=1",
            f"rollout.block_size={128 if device == 'npu' else 16}", "rollout.max_lora_rank=16",
            f"trainer.device={device}", "trainer.lora.rank=16", "trainer.lora.alpha=32",
            "trainer.optimizer.learning_rate=1e-2", "loop.mode=sync", f"loop.steps={steps}",
            "loop.prompts_per_step=4", "loop.eval_every=0", "loop.max_staleness=0", f"sync.mode={sync}",
            f"output.dir={out}", "output.tensorboard=false", "output.progress=false", "recovery.enabled=false"]


async def check_parity(cfg, trainer, rollout, prompts: list[str]) -> tuple[int, list[float], float, bool]:
    """Samples with the job's latest version, scores the same tokens on the trainer: (version,
    |trainer - rollout| per token, mean |policy - base| on the trainer, every token tagged with the version)."""
    from lorarl.v1 import common_pb2, rollout_pb2, trainer_pb2

    job = await trainer.GetJob(trainer_pb2.GetJobRequest(job_id=cfg.job_id))
    version = int(job.job.version)
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=cfg.rollout.max_tokens, seed=7)
    response = await rollout.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(text=p, apply_chat_template=cfg.data.chat_template) for p in prompts],
        sampling=sampling, policy=rollout_pb2.PolicySelector(job_id=cfg.job_id), request_id="npu-check-parity"))
    trajectories = [common_pb2.Trajectory(id=f"p{i}-c{j}", job_id=cfg.job_id, group_id=f"p{i}",
                                          prompt_token_ids=r.prompt_token_ids, completion_token_ids=c.token_ids,
                                          behavior_logprobs=c.logprobs, token_versions=c.token_versions)
                    for i, r in enumerate(response.results) for j, c in enumerate(r.completions) if c.token_ids]
    scored = await trainer.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id=cfg.job_id,
                                                                              trajectories=trajectories))
    base = await trainer.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id=cfg.job_id,
                                                                            trajectories=trajectories, reference=True))
    diffs = [abs(a - b) for t, s in zip(trajectories, scored.results, strict=True)
             for a, b in zip(t.behavior_logprobs, s.logprobs, strict=True)]
    effects = [abs(a - b) for s, r in zip(scored.results, base.results, strict=True)
               for a, b in zip(s.logprobs, r.logprobs, strict=True)]
    tagged = all(v == version for t in trajectories for v in t.token_versions)
    return version, diffs, sum(effects) / max(len(effects), 1), tagged


async def drive(cfg, stack, result: ModeResult) -> None:
    from lorarl.client.job.datasets import load_examples
    from lorarl.client.job.rewards import load_reward
    from lorarl.client.rl.loop import RLLoop, job_config_proto
    from lorarl.common.channel import aio_channel
    from lorarl.v1 import rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weightsync_pb2_grpc

    train = load_examples(cfg.data.source, "train", cfg.data.train_path)
    test = load_examples(cfg.data.source, "test", cfg.data.test_path)
    token = stack.token
    async with aio_channel(stack.address("trainer"), token=token) as tch, \
            aio_channel(stack.address("rollout"), token=token) as rch, \
            aio_channel(stack.address("weightsync"), token=token) as wch:
        trainer = trainer_pb2_grpc.TrainerServiceStub(tch)
        rollout = rollout_pb2_grpc.RolloutServiceStub(rch)
        await trainer.CreateJob(trainer_pb2.CreateJobRequest(
            job_id=cfg.job_id, config=job_config_proto(cfg, str(Path(cfg.model.path).resolve()))))
        loop = RLLoop(cfg, trainer, rollout, load_reward(cfg.data.reward), train, test, lambda row: None,
                      weightsync=weightsync_pb2_grpc.WeightSyncServiceStub(wch))
        await loop.run()
        version, diffs, effect, tagged = await check_parity(cfg, trainer, rollout, [e.prompt for e in test[:4]])
        result.version, result.tokens, result.versions_ok, result.effect = version, len(diffs), tagged, effect
        result.max_diff = max(diffs, default=math.inf)
        result.mean_diff = sum(diffs) / len(diffs) if diffs else math.inf


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, tmp: Path) -> ModeResult:
    from lorarl.client.job.config import load_job_config
    from lorarl.client.launch.services import local_stack

    result = ModeResult(mode)
    started = time.perf_counter()
    try:
        out = tmp / f"run-{mode}"
        cfg = load_job_config(None, job_overrides(mode, model_dir, args.device, args.steps, args.max_tokens, out))
        out.mkdir(parents=True, exist_ok=True)
        with local_stack(cfg, out) as stack:
            asyncio.run(drive(cfg, stack, result))
        if result.version != args.steps:
            result.error = f"the trainer is at v{result.version} after {args.steps} steps"
    except Exception as exc:  # one mode's failure is reported; the other still runs
        result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["npu", "cuda", "cpu"], default="npu")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen3-0.6B / 30B-A3B shapes")
    parser.add_argument("--experts", type=int, default=None, help="experts of the 30B-A3B shape (default: its 128)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest |trainer - rollout| logprob (default: 0.25 in bf16, 1e-3 in fp32)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--quick", action="store_true", help="1 layer, 2 steps, 8 tokens (the CPU smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.max_tokens = 1, 2, 8
    tolerance = args.tolerance if args.tolerance is not None else (1e-3 if args.device == "cpu" else 0.25)

    import torch

    from lorarl.assets.models import build_random_model

    with tempfile.TemporaryDirectory(prefix="lorarl-npu-check-") as name:
        tmp = Path(name)
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        modes = args.modes.split(",")
        unknown = sorted(set(modes) - set(MODES))
        if unknown:
            parser.error(f"unknown mode(s) {unknown}; one of {list(MODES)}")
        models = {}
        smoke = args.quick and args.device == "cpu"  # CI's run of the script: the shipped tiny models' shapes
        shapes = {"dense": "qwen3-tiny" if smoke else "qwen3-0.6b",
                  "moe": "qwen3-moe-tiny" if smoke else "qwen3-30b-a3b"}
        if set(modes) - {MOE_MODE}:  # the 0.6B layer shapes
            models["dense"] = tmp / "model"
            build_random_model(shapes["dense"], models["dense"], num_layers=args.layers, dtype=dtype)
        if MOE_MODE in modes:  # the 30B-A3B layer shapes
            models["moe"] = tmp / "moe"
            build_random_model(shapes["moe"], models["moe"], num_layers=args.layers, num_experts=args.experts,
                               dtype=dtype)
        results = [run_mode(mode, models["moe" if mode == MOE_MODE else "dense"], args, tmp) for mode in modes]
    print(f"## NPU check ({args.device}, {shapes['dense']} / {shapes['moe']} shapes, {args.layers} layers, "
          f"{args.steps} steps, tolerance {tolerance:g})")
    print("| mode | version | tokens | max abs d logp | mean abs d logp | adapter effect | s | check |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for r in results:
        print(r.row(tolerance))
    return 0 if all(r.ok(tolerance) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
