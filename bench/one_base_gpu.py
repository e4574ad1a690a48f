"""One base on one GPU (#44 step 6): two processes compute on ONE copy of the base, shared by CUDA IPC.

For a machine with one GPU and only torch and transformers (no vLLM), a few minutes:

1. a random-init Qwen3-8B-shaped model (4 layers, the full 151,936-token vocabulary, bf16) is laid out in the
   shared-base format (lorarl.contract.base_segment: the engine's fused layout) and copied ONCE into one device
   buffer, which this process holds and exports by CUDA IPC (lorarl.platform.cuda_ipc), as lorarl's launcher
   holds the memory file on CPU;
2. the rollout side, a process of its own, opens the handle: a transformers model built on the meta device whose
   parameters are then the shared buffer's views (the HF engine, named as such: vLLM is not on that machine);
   it generates greedy tokens from that memory (tokens/s);
3. the trainer side, this process, is lorarl's torch engine whose base is aliased to the same memory
   (lorarl.trainer.engines.torch.shared_base.alias_base, checked value for value at load), rank-32 LoRA;
4. device memory: the card's used bytes (torch.cuda.mem_get_info) after the base is placed, after the rollout
   attaches and after the trainer attaches, each process's own allocations, and nvidia-smi's per-process
   figures: the base is on the card once;
5. an adapter handoff by IPC (the trainer's adapter tensors in one device buffer; the rollout opens its handle
   and loads them into its LoRA layers), timed, then the same tokens' logprobs on both sides;
6. the trainer's steady-state step time (forward_backward + optim_step, after a warm-up step) at 2K, 8K and 32K
   tokens (2,048-token sequences), and the fraction of the card's bf16 peak (measured here: an 8192^3 matmul)
   that 4 x weight-matrix parameters x tokens per second is (the forward and the input gradients: the frozen base
   has no weight gradients; attention's own FLOPs and recomputation are not counted).

`--device cpu --quick` runs the same two processes on CPU with the shipped tiny model, the memory file
(lorarl.platform.shared_memory) in place of CUDA IPC: tests/unit/test_bench_scripts.py runs it, so the script does
not rot between GPU sessions. bench/gpu_check.py runs it as one of its parts.

    python bench/one_base_gpu.py                               # on the GPU machine
    python bench/one_base_gpu.py --device cpu --quick --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: What this benchmark's figures depend on (bench/results.py's stale check).
MEASURES = ("lorarl.contract.base_segment", "lorarl.platform", "lorarl.trainer")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## One base on one GPU"
TAG = "ONEBASE "  # the rollout process's answers on stdout (its libraries may print too)
GIB = 1 << 30
RANK = 32
SEQUENCE = 2048


# ----------------------------------------------------------------------------------------------- rollout side
def _open_base(shared: str) -> Any:
    from lorarl.contract.base_segment import open_shared_base

    return open_shared_base(shared)


def _hf_model_on(segment: Any, model_dir: str, device: str) -> Any:
    """A transformers model whose every parameter is the shared segment's view (built on meta: no copy of its
    own ever exists), its rotary tables made on ``device``; ValueError if a parameter is left unshared."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    views = segment.part_views()
    dtype = next(iter(views.values())).dtype
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers before 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.load_state_dict(views, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, module in model.named_modules():
        if hasattr(module, "inv_freq"):  # rotary tables: buffers computed from the config, not weights
            fresh = type(module)(config=getattr(module, "config", config)).to(device)  # transformers 5: no device
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], fresh)
    unshared = [n for n, p in model.named_parameters() if p.is_meta or not segment.holds(p)]
    if unshared:
        raise ValueError(f"parameters not in the shared base: {unshared[:6]}")
    return model.eval()


def rollout_main(args: argparse.Namespace) -> int:
    """The rollout process: answers one JSON command per stdin line, on stdout after TAG."""
    import torch

    from lorarl.trainer.rl.lora import LoraConfig, attach_lora, load_peft_state_dict

    model, segment = None, None
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        started = time.perf_counter()
        if op == "attach":
            segment = _open_base(args.shared)
            model = _hf_model_on(segment, args.model, args.device)
            attach_lora(model, LoraConfig(rank=RANK, alpha=2 * RANK), seed=1)
            model.to(args.device)  # the adapters (the base is there already: its views)
            answer = {"parameters": sum(1 for _ in model.named_parameters()), "seconds": 0.0,
                      "allocated": torch.cuda.memory_allocated() if args.device == "cuda" else 0}
        elif op == "generate":
            ids = torch.tensor(command["prompts"], device=args.device)
            with torch.no_grad():
                model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)  # warm-up
                _sync(args.device)
                started = time.perf_counter()
                out = model.generate(ids, max_new_tokens=command["new_tokens"], min_new_tokens=command["new_tokens"],
                                     do_sample=False)
                _sync(args.device)
            new = out.shape[0] * (out.shape[1] - ids.shape[1])
            answer = {"tokens": new, "tokens_per_s": new / (time.perf_counter() - started)}
        elif op == "adapter":
            tensors = _adapter_views(command, args.device)
            load_peft_state_dict(model, tensors)
            _sync(args.device)
            answer = {}
        elif op == "logprobs":
            answer = {"logprobs": _completion_logprobs(model, command["prompt"], command["completion"], args.device)}
        elif op == "exit":
            break
        else:
            raise ValueError(f"unknown op {op!r}")
        answer["seconds"] = answer.get("seconds") or time.perf_counter() - started
        print(TAG + json.dumps(answer), flush=True)
    return 0


def _adapter_views(command: dict[str, Any], device: str) -> dict[str, Any]:
    """The trainer's adapter tensors from the buffer its handle names (CUDA IPC, or its memory file on CPU)."""
    import torch

    from lorarl.contract.base_segment import TORCH_DTYPES

    if device == "cuda":
        from lorarl.platform.cuda_ipc import open_buffer

        flat = open_buffer(command["handle"])
    else:
        from lorarl.platform.shared_memory import read_buffers

        (flat,) = read_buffers(command["pid"], command["fd"], [command["nbytes"]])
    out = {}
    for name, dtype, shape, offset, nbytes in command["tensors"]:
        out[name] = flat[offset:offset + nbytes].view(getattr(torch, TORCH_DTYPES[dtype])).view(shape)
    return out


def _completion_logprobs(model: Any, prompt: list[int], completion: list[int], device: str) -> list[float]:
    import torch

    ids = torch.tensor([prompt + completion], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None])
    return picked[:, 0].tolist()


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- trainer side
class Rollout:
    """The rollout process, spoken to one command at a time."""

    def __init__(self, shared: str, model_dir: str, device: str, pass_fds: tuple[int, ...]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--role", "rollout", "--shared", shared, "--model", model_dir,
             "--device", device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            pass_fds=pass_fds)

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        raise RuntimeError(f"the rollout process ended (exit code {self.process.wait()}) during {command['op']}")

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin
            self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)


def device_used(device: str) -> float:
    """Bytes in use on the card, by every process (what the driver reports)."""
    if device != "cuda":
        return float("nan")
    import torch

    free, total = torch.cuda.mem_get_info()
    return float(total - free)


def nvidia_smi() -> dict[int, float]:
    """pid -> MiB nvidia-smi attributes to it ({} where nvidia-smi is not there)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in out.strip().splitlines():  # "No running processes found" or an NVML error: no row
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 2:
            continue
        pid, mib = parts
        if pid.isdigit() and mib.replace(".", "").isdigit():
            found[int(pid)] = float(mib)
    return found


def peak_tflops(device: str, quick: bool) -> float:
    """The card's measured dense matmul rate (bf16 on a GPU, fp32 on CPU), TFLOP/s."""
    import torch

    n = 512 if quick else 8192
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    repeats = 3 if quick else 20
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - started) / 1e12


def records(tokens: int, vocab: int, sequence: int) -> list[Any]:
    from lorarl.trainer.engines.api import TrajectoryRecord

    prompt = sequence // 4
    completion = sequence - prompt
    return [TrajectoryRecord([(97 * i + j) % (vocab - 1) + 1 for j in range(prompt)],
                             [(31 * j + i) % (vocab - 1) + 1 for j in range(completion)], [-1.0] * completion,
                             [0] * completion, float(i % 2), "g0") for i in range(max(2, tokens // sequence))]


def export_adapter(engine: Any, device: str) -> tuple[dict[str, Any], Any]:
    """The trainer's adapter tensors in one buffer, and what the rollout needs to open it (the buffer is returned so
    the caller keeps it alive until the rollout has loaded it)."""
    import torch

    tensors = dict(engine.iter_adapter_tensors())
    rows, parts, offset = [], [], 0
    codes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    for name, t in tensors.items():
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        rows.append([name, codes[t.dtype], list(t.shape), offset, raw.numel()])
        parts.append(raw)
        offset += raw.numel()
    if device == "cuda":
        from lorarl.platform.cuda_ipc import export_buffer

        flat = torch.cat(parts)
        return {"op": "adapter", "handle": export_buffer(flat), "tensors": rows}, flat
    from lorarl.platform.shared_memory import write_buffers

    fd, nbytes = write_buffers([torch.cat(parts)])
    return {"op": "adapter", "pid": os.getpid(), "fd": fd, "nbytes": nbytes, "tensors": rows}, fd


def run(device: str, quick: bool, tmp: Path) -> list[str]:
    import torch

    from lorarl.contract import base_segment
    from lorarl.platform import shared_memory
    from lorarl.trainer.engines.api import MemorySpec, OptimizerSpec, TrainingSpec
    from lorarl.trainer.engines.torch.engine import TorchEngine
    from lorarl.trainer.engines.torch.shared_base import BaseRegistry
    from lorarl.trainer.rl.lora import LoraConfig

    if quick:
        model_dir, dtype = str(ROOT / "lorarl/assets/models/qwen3-tiny"), "float32"
        lengths, sequence, new_tokens = (64, 128), 32, 8
    else:
        from lorarl.assets.models import build_random_model

        model_dir, dtype = str(tmp / "qwen3-8b-4"), "bfloat16"
        build_random_model("qwen3-8b", Path(model_dir), num_layers=4, dtype=torch.bfloat16)
        lengths, sequence, new_tokens = (2048, 8192, 32768), SEQUENCE, 128
    lines = ["| check | figure |", "| --- | ---: |"]

    def row(name: str, value: str) -> None:
        lines.append(f"| {name} | {value} |")
        print(lines[-1], flush=True)

    used0 = device_used(device)
    fd = shared_memory.create()
    base_segment.build(fd, model_dir)
    host = base_segment.open_segment(shared_memory.path_of(fd))
    row("base in the shared layout", f"{host.nbytes / 2**20:,.1f} MiB ({len(host.tensors)} tensors)")
    if device == "cuda":
        held = base_segment.to_device(host, "cuda")
        torch.cuda.synchronize()
        shared = str(base_segment.write_device_handle(held, tmp / "base.json"))
        child_shared, pass_fds = shared, ()
    else:
        held, shared = host, shared_memory.path_of(fd)
        child_shared, pass_fds = shared, (fd,)
    used1 = device_used(device)
    rollout = Rollout(child_shared, model_dir, device, pass_fds)
    try:
        attached = rollout.ask(op="attach")
        used2 = device_used(device)
        spec = TrainingSpec(base_model_path=model_dir, device=device, dtype=dtype,
                            lora=LoraConfig(rank=RANK, alpha=2 * RANK),
                            # a large rate: the one step before the handoff must move the logprobs visibly
                            optimizer=OptimizerSpec(learning_rate=1e-2),
                            memory=MemorySpec(activation_checkpointing="auto"))
        engine = TorchEngine(spec, bases=BaseRegistry(shared))
        base_params = [(n, p) for n, p in engine.base.model.named_parameters() if "lora_" not in n]
        mapped = getattr(engine.base.model, "lorarl_segment", None)  # the trainer's own mapping of the shared base
        in_segment = sum(mapped.holds(p) for _, p in base_params) if mapped is not None else 0
        if device == "cuda":  # the load's per-tensor comparison copies, freed but kept by torch's allocator
            torch.cuda.empty_cache()
        used3 = device_used(device)
        row("trainer's base parameters that are views of the shared base", f"{in_segment} of {len(base_params)}")
        row("rollout's parameters built as views of the shared base (else it does not start)",
            f"all ({attached['parameters']} with its LoRA)")
        if device == "cuda":
            smi = nvidia_smi()
            row("card in use: before / base placed / rollout attached / trainer attached (GiB)",
                f"{used0 / GIB:.2f} / {used1 / GIB:.2f} / {used2 / GIB:.2f} / {used3 / GIB:.2f}")
            row("card in use beyond one base copy once both attached (contexts, adapters, Adam; GiB)",
                f"{(used3 - used0 - held.nbytes) / GIB:.2f}")
            row("torch.cuda.memory_allocated: holder+trainer / rollout (GiB)",
                f"{torch.cuda.memory_allocated() / GIB:.2f} / {attached['allocated'] / GIB:.2f}")
            row("nvidia-smi per process: holder+trainer / rollout (MiB)",
                f"{smi.get(os.getpid(), float('nan')):.0f} / {smi.get(rollout.process.pid, float('nan')):.0f}")
        vocab = engine.vocab_size
        prompts = [[(13 * i + j) % (vocab - 1) + 1 for j in range(16)] for i in range(4 if quick else 16)]
        generated = rollout.ask(op="generate", prompts=prompts, new_tokens=new_tokens)
        row(f"rollout (HF engine) greedy generation from the shared base, {len(prompts)} x {new_tokens} tokens",
            f"{generated['tokens_per_s']:.1f} tokens/s")
        batch = records(4 * sequence, vocab, sequence)
        engine.train_step(batch)  # the adapter moves off zero: a handoff that did nothing would show
        trainer_lp = engine.compute_logprobs(batch[:1])[0]
        stale = rollout.ask(op="logprobs", prompt=batch[0].prompt_token_ids,
                            completion=batch[0].completion_token_ids)["logprobs"]
        row("logprobs of the same tokens before the handoff (the rollout's adapter still the initial one): max abs "
            "difference", f"{max(abs(a - b) for a, b in zip(trainer_lp, stale, strict=True)):.4f}")
        started = time.perf_counter()
        command, keep = export_adapter(engine, device)
        rollout.ask(**command)
        handoff = time.perf_counter() - started
        if device != "cuda":
            os.close(keep)
        del keep
        row("adapter handoff by IPC (trainer's tensors -> rollout's LoRA layers, loaded)",
            f"{handoff * 1000:.1f} ms ({sum(r[4] for r in command['tensors']) / 2**20:.1f} MiB)")
        rollout_lp = rollout.ask(op="logprobs", prompt=batch[0].prompt_token_ids,
                                 completion=batch[0].completion_token_ids)["logprobs"]
        gap = max(abs(a - b) for a, b in zip(trainer_lp, rollout_lp, strict=True))
        row("logprobs of the same tokens after the handoff, trainer vs rollout: max abs difference", f"{gap:.4f}")
        flops_per_token = 4 * sum(p.numel() for n, p in base_params if p.dim() == 2 and "embed_tokens" not in n)
        if engine.base.model.config.tie_word_embeddings:
            flops_per_token += 4 * engine.base.model.get_input_embeddings().weight.numel()
        peak = peak_tflops(device, quick)
        row(f"measured matmul peak ({'bf16' if device == 'cuda' else 'fp32'})", f"{peak:.2f} TFLOP/s")
        for tokens in lengths:
            batch = records(tokens, vocab, sequence)
            engine.train_step(batch)  # warm-up at this size
            _sync(device)
            steps = 2
            started = time.perf_counter()
            for _ in range(steps):
                engine.train_step(batch)
            _sync(device)
            seconds = (time.perf_counter() - started) / steps
            rate = flops_per_token * tokens / seconds / 1e12
            row(f"trainer step at {tokens:,} tokens ({len(batch)} x {sequence})",
                f"{seconds:.3f} s, {rate:.2f} TFLOP/s = {rate / peak:.0%} of peak")
    finally:
        rollout.close()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="the shipped tiny model, short batches (the CPU test)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--role", default="trainer", help=argparse.SUPPRESS)
    parser.add_argument("--shared", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # expandable segments share memory by another handle kind (pidfd), which containers may refuse
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if args.role == "rollout":
        return rollout_main(args)
    with tempfile.TemporaryDirectory(prefix="lorarl-one-base-") as tmp:
        lines = run(args.device, args.quick, Path(tmp))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {time.strftime('%Y-%m-%d')}, {args.device}"
                      + (" (quick)" if args.quick else ""), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
