"""Sharded megatron models across gloo processes compute the single-process logits (TP, EP, PP on CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorarl.trainer.engines.megatron import convert
from lorarl.trainer.engines.megatron.model import build_gpt_model, compute_logits, load_hf_state
from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel, teardown
from tests.support.megatron_workers import GRAD_PARAM, backward_grad, logits_worker
from tests.support.workers import run_workers

pytestmark = pytest.mark.slow  # two spawned ranks per test

ASSETS = Path(__file__).resolve().parents[3] / "lorarl" / "assets" / "models"
TOLERANCE = 1e-4  # fp32 reduction order differs across shards (observed up to 1.1e-5 on logits ~7)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 264, (1, 5), generator=g), torch.randint(0, 264, (2, 17), generator=g)]


@pytest.fixture(scope="module")
def reference() -> Iterator[dict[str, tuple[list[torch.Tensor], torch.Tensor]]]:
    """TP=PP=EP=1 logits of both models and the gradient `backward_grad` takes, computed in this process."""
    init_parallel(ParallelSettings(), "cpu")
    try:
        out = {}
        for name in ("qwen3-tiny", "qwen3-moe-tiny"):
            built = build_gpt_model(ASSETS / name, ParallelSettings())
            with torch.no_grad():
                logits = [compute_logits(built.model, ids, built.layout.vocab_size) for ids in batches()]
            out[name] = (logits, backward_grad(built, batches()[-1]))
        yield out
    finally:
        teardown()


@pytest.mark.parametrize(("name", "tp", "pp", "ep"), [
    ("qwen3-tiny", 2, 1, 1), ("qwen3-moe-tiny", 2, 1, 1), ("qwen3-moe-tiny", 1, 1, 2), ("qwen3-tiny", 1, 2, 1)],
    ids=["dense-tp2", "moe-tp2", "moe-ep2", "dense-pp2"])
def test_two_ranks_match_one(reference: dict[str, tuple[list[torch.Tensor], torch.Tensor]], tmp_path: Path,
                             name: str, tp: int, pp: int, ep: int) -> None:
    run_workers(logits_worker, 2, (str(ASSETS / name), tp, pp, ep, batches(), str(tmp_path)), timeout_s=150)
    want_logits, want_grad = reference[name]

    holders = [0, 1] if pp == 1 else [1]  # with pp=2 only the last stage has logits
    assert sorted(p.name for p in tmp_path.glob("logits-*")) == [f"logits-rank{r}.pt" for r in holders]
    for rank in holders:
        for got, want in zip(torch.load(tmp_path / f"logits-rank{rank}.pt"), want_logits, strict=True):
            assert got.shape == want.shape
            assert (got - want).abs().max().item() <= TOLERANCE, f"rank {rank}"

    # the ranks' real module state dicts gather back into the unsharded checkpoint
    layout = convert.layout_from_hf(convert.read_hf_config(ASSETS / name))
    saved = [torch.load(tmp_path / f"state-rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert len({s["coords"] for s in saved}) == 2
    gathered = convert.gather_states({s["coords"]: s["state"] for s in saved}, layout)
    full = convert.hf_to_megatron(load_hf_state(ASSETS / name, torch.float32), layout)
    assert gathered.keys() == full.keys()
    for key in full:
        assert torch.equal(gathered[key], full[key]), key

    if pp == 1:  # backward through the sharded model (TP all-reduces, MoE token all-gather) gives the same gradient
        grads = [s["grad"] for s in sorted(saved, key=lambda s: s["coords"].tp_rank)]
        grad = convert.tp_merge(GRAD_PARAM, grads) if tp > 1 else grads[0]
        assert want_grad.abs().max() > 0
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-4)
