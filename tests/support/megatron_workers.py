"""Worker bodies shared by the Megatron multi-rank tests (run by tests/support/workers.py's run_workers)."""

from __future__ import annotations

from pathlib import Path

import torch

GRAD_PARAM = "decoder.layers.0.self_attention.linear_qkv.weight"


def logits_worker(rank: int, world_size: int, init_method: str, model_dir: str, tp: int, pp: int, ep: int,
                  batches: list[torch.Tensor], out_dir: str) -> None:
    """Builds the sharded model for (tp, pp, ep); writes this rank's logits per batch (if it has them), its
    state and (pp == 1) the gradient of GRAD_PARAM for `backward_loss` on the last batch."""
    from lorarl.trainer.engines.megatron.convert import RankCoords
    from lorarl.trainer.engines.megatron.model import build_gpt_model, compute_logits
    from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel, teardown

    torch.set_num_threads(1)
    settings = ParallelSettings(tp=tp, pp=pp, ep=ep)
    init_parallel(settings, "cpu", rank=rank, world_size=world_size, init_method=init_method, timeout_s=90)
    try:
        built = build_gpt_model(model_dir, settings)
        with torch.no_grad():
            logits = [compute_logits(built.model, ids, built.layout.vocab_size) for ids in batches]
        out = Path(out_dir)
        if logits[0] is not None:
            torch.save(logits, out / f"logits-rank{rank}.pt")
        state = {k: v for k, v in built.model.state_dict().items() if not k.endswith("_extra_state")}
        grad = backward_grad(built, batches[-1]) if pp == 1 else None
        torch.save({"coords": RankCoords.current(), "state": state, "grad": grad}, out / f"state-rank{rank}.pt")
    finally:
        teardown()


def backward_grad(built: object, ids: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of GRAD_PARAM for sum(logsumexp(logits)), in training mode."""
    from lorarl.trainer.engines.megatron.model import compute_logits, set_training

    weight = dict(built.model.named_parameters())[GRAD_PARAM]
    weight.requires_grad_(True)
    set_training(built.model, True)
    compute_logits(built.model, ids, built.layout.vocab_size).logsumexp(-1).sum().backward()
    set_training(built.model, False)
    weight.requires_grad_(False)
    return weight.grad.detach().clone()
