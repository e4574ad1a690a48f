"""LoRA on megatron parallel linears: TP=1 equals plain full-weight math, and TP=2 (two gloo processes)
computes exactly what TP=1 computes — outputs, input gradients, adapter gradients and one AdamW step —
for column (qkv, gated fc1), row (proj, fc2) and expert layers whose reduction the dispatcher does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lorarl.trainer.engines.megatron.lora import (
    MegatronLora,
    adapted_modules,
    adapter_spec,
    add_lora,
    sum_forward,
    sum_grad,
)
from lorarl.trainer.rl.lora import LoraConfig
from tests.support.workers import run_workers

H, Q, FF, EF, R, S, B = 16, 24, 12, 8, 4, 5, 2  # hidden, qkv rows, ffn, expert ffn, rank, seq, batch
LORA = LoraConfig(rank=R, alpha=8.0)
LAYERS = {  # adapter name -> (kind, in, out); names pick the TP split (qkv contiguous, fc1 gated)
    "decoder.layers.0.self_attention.linear_qkv": ("column", H, Q),
    "decoder.layers.0.self_attention.linear_proj": ("row", Q, H),
    "decoder.layers.0.mlp.linear_fc1": ("column", H, 2 * FF),
    "decoder.layers.0.mlp.linear_fc2": ("row", FF, H),
    "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1": ("column", H, 2 * EF),
    "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2": ("row", EF, H),
}


def case() -> dict[str, torch.Tensor]:
    """Full weights, non-zero adapters, an input and a loss weighting, from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    out = {"x": torch.randn(S, B, H, generator=g), "w": torch.randn(S, B, H, generator=g)}
    for name, (_, fan_in, fan_out) in LAYERS.items():
        out[f"{name}.weight"] = torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5
        out[f"{name}.lora_A"] = torch.randn(R, fan_in, generator=g) * 0.1
        out[f"{name}.lora_B"] = torch.randn(fan_out, R, generator=g) * 0.1
    return out


def glu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference(c: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block in plain torch on full merged weights: W + scale * B A."""
    params = {k: v.clone().requires_grad_(True) for k, v in c.items() if "lora" in k}
    x = c["x"].clone().requires_grad_(True)

    def lin(name: str, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, c[f"{name}.weight"] + LORA.scale * params[f"{name}.lora_B"] @ params[f"{name}.lora_A"])

    names = list(LAYERS)
    z = x + lin(names[1], torch.tanh(lin(names[0], x)))
    z = z + lin(names[3], glu(lin(names[2], z)))
    out = z + lin(names[5], glu(lin(names[4], z)))
    (out * c["w"]).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, **{f"{k}.grad": p.grad for k, p in params.items()}}


def run_block(c: dict[str, torch.Tensor], steps: int = 1) -> dict[str, torch.Tensor]:
    """The same block from megatron parallel linears on this rank's shards, LoRA hooked on; then AdamW."""
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from lorarl.trainer.engines.megatron import convert

    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                 perform_initialization=False)
    modules, adapters = [], []
    for name, (kind, fan_in, fan_out) in LAYERS.items():
        expert = ".experts." in name
        if kind == "column":
            m = ColumnParallelLinear(fan_in, fan_out, config=config, init_method=None, bias=False,
                                     gather_output=False, is_expert=expert)
        else:
            m = RowParallelLinear(fan_in, fan_out, config=config, init_method=None, bias=False,
                                  input_is_parallel=True, skip_bias_add=expert, is_expert=expert)
        with torch.no_grad():
            m.weight.copy_(convert.tp_shard(f"{name}.weight", c[f"{name}.weight"], tp_rank, tp))
        m.weight.requires_grad_(False)
        adapters.append(add_lora(m, adapter_spec(m, name, f"{name}.weight"), LORA, seed=0))
        modules.append(m)
    assert adapters[4].spec.explicit_comm == (tp > 1)  # experts leave the TP sum to the dispatcher
    lora = MegatronLora(adapters, ep_group=None)
    lora.load_full({k: v for k, v in c.items() if "lora" in k})
    x = c["x"].clone().requires_grad_(True)
    expert_group = ps.get_expert_tensor_parallel_group()

    def call(i: int, h: torch.Tensor) -> torch.Tensor:
        return modules[i](h)[0]

    z = x + call(1, torch.tanh(call(0, x)))
    z = z + call(3, glu(call(2, z)))
    # The dispatcher's part for experts: input gradients summed over expert-TP, partial outputs summed.
    out = z + sum_forward(call(5, glu(call(4, sum_grad(z, expert_group)))), expert_group)
    (out * c["w"]).sum().backward()
    params = lora.named_parameters()
    grads = lora.gather({n: p.grad for n, p in params.items()})
    result = {"out": out.detach(), "x_grad": x.grad, **{f"{k}.grad": v for k, v in grads.items()}}
    optimizer = torch.optim.AdamW(list(params.values()), lr=0.05, weight_decay=0.01)
    for _ in range(steps):
        optimizer.step()
    result.update({f"{k}.stepped": v for k, v in lora.full_tensors().items()})
    result["grad_norm"] = lora.grad_norm()
    return result


def tp_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel, teardown

    torch.set_num_threads(1)
    init_parallel(ParallelSettings(tp=world_size), "cpu", rank=rank, world_size=world_size, init_method=init_method,
                  timeout_s=90)
    try:
        result = run_block(case())
        if rank == 0:
            torch.save(result, Path(out_dir) / "tp.pt")
    finally:
        teardown()


@pytest.fixture(scope="module")
def tp1() -> dict[str, torch.Tensor]:
    from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel

    init_parallel(ParallelSettings(), "cpu")
    return run_block(case())


def test_tp1_block_equals_plain_full_weight_math(tp1: dict[str, torch.Tensor]) -> None:
    ref = reference(case())
    assert ref.keys() <= tp1.keys()
    for key, want in ref.items():
        torch.testing.assert_close(tp1[key], want, rtol=1e-5, atol=1e-4, msg=key)
    assert all(ref[f"{n}.lora_A.grad"].abs().max() > 1e-3 for n in LAYERS)  # every adapter really learns
    norm = torch.cat([ref[k].flatten() for k in ref if k.endswith(".grad") and "lora" in k]).norm()
    torch.testing.assert_close(tp1["grad_norm"], norm, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_tp2_computes_exactly_what_tp1_computes(tp1: dict[str, torch.Tensor], tmp_path: Path) -> None:
    run_workers(tp_worker, 2, (str(tmp_path),), timeout_s=120)
    tp2 = torch.load(tmp_path / "tp.pt")
    assert tp2.keys() == tp1.keys()
    for key, want in tp1.items():
        torch.testing.assert_close(tp2[key], want, rtol=1e-5, atol=1e-5, msg=key)
    moved = [k for k in tp1 if k.endswith(".stepped")]
    assert len(moved) == 2 * len(LAYERS)
    assert all((tp1[k] - case()[k.removesuffix(".stepped")]).abs().max() > 1e-3 for k in moved)


def test_fused_targets_need_all_of_their_projections() -> None:
    assert adapted_modules(LoraConfig()) == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert adapted_modules(LoraConfig(target_modules=("o_proj", "down_proj"))) == {"linear_proj", "linear_fc2"}
    with pytest.raises(ValueError, match="linear_qkv"):
        adapted_modules(LoraConfig(target_modules=("q_proj", "v_proj")))
