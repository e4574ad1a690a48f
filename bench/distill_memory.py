"""Teachers cost a distilling rollout its adapters only (issue #47): one job's rollout, sized by the launcher, with
two rank-16 teacher adapters loaded beside the student's and scoring every completion, against the same job's
rollout without teachers (the same student, the same batch), side by side in one run.

A random-init model with Qwen3-0.6B's real shapes (2 layers, the full vocabulary, fp32) is served by one rollout
service started as `lorarl run` starts it (its section from lorarl.client.launch.services.stack_sections: with
teachers it has a LoRA slot more per teacher). Each side loads the student's rank-16 adapter (and, with teachers,
the two teachers'), then runs the same Generate: 8 prompts x 4 samples x 64 tokens, with teachers each prompt
scored by one of them. The peak resident set (VmHWM) of the rollout process and of its vLLM engine core are set
side by side; the issue's bar is the engine core within 5%.

    python bench/distill_memory.py            # ~3 minutes on 2 CPU cores
    python bench/distill_memory.py --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
#: The code this benchmark's figures depend on (bench/results.py): the rollout and how the launcher sizes it.
MEASURES = ("lorarl/rollout", "lorarl/client/launch", "lorarl/client/job", "lorarl/contract")
HEADING = "## On-policy distillation: the rollout's memory with teachers loaded"
SHAPE, LAYERS, RANK, TEACHERS = "qwen3-0.6b", 2, 16, 2
PROMPTS, SAMPLES, TOKENS = 8, 4, 64
BAR = 0.05


def adapter(model: Path, seed: int) -> dict:
    """A rank-16 adapter on every linear layer of ``model``, small random values (PEFT names)."""
    import torch

    from lorarl.contract.lora import LINEAR_TARGETS
    from lorarl.contract.peft import safetensors_shapes, tensor_name

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in safetensors_shapes(sorted(model.glob("*.safetensors"))).items():
        module = name.removesuffix(".weight")
        if len(shape) == 2 and module.rsplit(".", 1)[-1] in LINEAR_TARGETS:
            tensors[tensor_name(module, "A")] = torch.randn(RANK, shape[1], generator=g) * 0.01
            tensors[tensor_name(module, "B")] = torch.randn(shape[0], RANK, generator=g) * 0.01
    return tensors


def job(model: Path, out: Path, teachers: list[Path]):
    """The distilling job (teachers) or the same job without them, as a launcher sizes its rollout."""
    import yaml

    from lorarl.client.job.config import load_job_config

    overrides = [f"model.path={model}", f"output.dir={out}", "trainer.lora.rank=16", "trainer.lora.alpha=32",
                 f"rollout.max_tokens={TOKENS}", "rollout.kv_cache_gib=1", "data.max_prompt_tokens=32"]
    raw = yaml.safe_load((ROOT / "examples/distill/two-tasks/student.yaml").read_text())
    if teachers:
        for teacher, path in zip(raw["distill"]["teachers"], teachers, strict=True):
            teacher["adapter"] = str(path)
    else:  # the same student by RL: no teachers, a loss that reads none, its 64 completions a step as groups of 4
        raw["distill"]["teachers"], raw["trainer"]["loss"] = [], {"type": "grpo"}
        raw["rollout"]["group_size"], raw["loop"]["prompts_per_step"] = 4, raw["loop"]["prompts_per_step"] // 4
    file = out.parent / f"{out.name}.yaml"
    file.write_text(yaml.safe_dump(raw))
    return load_job_config(str(file), overrides)


async def drive(address: str, token: str, fingerprint: str, adapters: dict[str, dict], teachers: list[str]) -> float:
    """Loads the adapters, runs the batch (scored by ``teachers`` when given); the batch's seconds."""
    from lorarl.common.channel import aio_channel
    from lorarl.contract.lora import LoraSpec
    from lorarl.rollout.client import load_weights_stream
    from lorarl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    spec = LoraSpec(rank=RANK, alpha=2.0 * RANK).to_proto()
    async with aio_channel(address, token=token) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for job_id, tensors in adapters.items():
            await stub.LoadWeights(load_weights_stream(job_id, 1, tensors, common_pb2.SYNC_MODE_ADAPTER, fingerprint,
                                                       spec))
        rng = random.Random(0)
        prompts = [rollout_pb2.Prompt(token_ids=[rng.randrange(1000, 100_000) for _ in range(24)],
                                      teacher_weights=[float(i % TEACHERS == t) for t in range(TEACHERS)]
                                      if teachers else [])
                   for i in range(PROMPTS)]
        started = time.perf_counter()
        reply = await stub.Generate(rollout_pb2.GenerateRequest(
            prompts=prompts, sampling=common_pb2.SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=TOKENS,
                                                                ignore_eos=True, seed=1),
            policy=rollout_pb2.PolicySelector(job_id="student", version=1),
            teachers=[rollout_pb2.PolicySelector(job_id=t, version=1) for t in teachers]), timeout=1800)
        if teachers and not all(c.teacher_logprobs for r in reply.results for c in r.completions):
            raise RuntimeError("a completion came back unscored")
        return time.perf_counter() - started


def measure(model: Path, tmp: Path, with_teachers: bool) -> dict[str, float]:
    from bench.scaling import peak_rss_gib
    from bench.service_memory import named_processes
    from lorarl.client.launch.local import LocalStack
    from lorarl.client.launch.services import stack_sections
    from lorarl.contract.fingerprint import base_model_fingerprint
    from lorarl.contract.peft import write_peft_files

    name = "teachers" if with_teachers else "plain"
    dirs = []
    adapters = {"student": adapter(model, 1)}
    if with_teachers:
        from lorarl.contract.lora import LoraSpec

        for t in range(TEACHERS):
            tensors = adapter(model, 10 + t)
            adapters[f"student.teacher.t{t}"] = tensors
            dirs.append(write_peft_files(tmp / f"teacher-{t}", tensors, LoraSpec(rank=RANK).peft_config(str(model))))
    cfg = job(model, tmp / name, dirs)
    section = stack_sections(cfg, tmp / name)["rollout"]
    with LocalStack(tmp / name / "services", {"rollout": section}, services=("rollout",)) as stack:
        teachers = [j for j in adapters if j != "student"]
        seconds = asyncio.run(drive(stack.address("rollout"), stack.token, base_model_fingerprint(model), adapters,
                                    teachers))
        peaks = {"max_loras": float(section["max_loras"]), "seconds": seconds}
        for key, pid in named_processes("rollout", stack.processes["rollout"].process.pid):
            peaks[key] = peak_rss_gib(pid)
    return peaks


def main(argv: list[str] | None = None) -> int:
    import torch

    from lorarl.assets.models import build_random_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print, leave bench/RESULTS.md as it is")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lorarl-distill-memory-") as name:
        tmp = Path(name)
        model = tmp / "model"
        build_random_model(SHAPE, model, num_layers=LAYERS, dtype=torch.float32)
        plain, teachers = measure(model, tmp, False), measure(model, tmp, True)
    body = ["| process | without teachers: peak GiB | with two rank-16 teachers: peak GiB | ratio |",
            "| --- | ---: | ---: | ---: |"]
    ok = True
    for key in ("rollout-0", "rollout-0 engine core"):
        ratio = teachers[key] / plain[key]
        ok = ok and (key != "rollout-0 engine core" or abs(ratio - 1) <= BAR)
        body.append(f"| {key} | {plain[key]:.3f} | {teachers[key]:.3f} | {ratio:.3f} |")
    body += ["", f"{SHAPE} shape, {LAYERS} layers, random init, fp32; the rollout as the launcher sizes it "
                 f"(max_loras {plain['max_loras']:.0f} without, {teachers['max_loras']:.0f} with); one Generate of "
                 f"{PROMPTS} prompts x {SAMPLES} samples x {TOKENS} tokens under the student's rank-16 adapter, "
                 f"{plain['seconds']:.1f} s without teachers, {teachers['seconds']:.1f} s with each prompt's "
                 f"completions scored by one of the two (one prefill per row, no decode). Peak = VmHWM. Engine "
                 f"core within {100 * BAR:.0f}%: {'yes' if ok else 'NO'}."]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {SHAPE} x {LAYERS} layers, two rank-{RANK} teachers", body)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
