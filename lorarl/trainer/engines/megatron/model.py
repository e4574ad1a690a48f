"""Builds a frozen megatron-core GPTModel from a Hugging Face Qwen3 directory, sharded for this rank.

Uses megatron's local (non Transformer-Engine) layer specs, so the same code runs on CPU (gloo),
CUDA and Ascend. Weights come from the HF safetensors through `convert`, each rank keeping only its
TP/EP/PP slice; every base parameter is frozen, LoRA is added on top by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from safetensors import safe_open

from lorarl.trainer.engines.megatron import convert, cpu_compat
from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig


class MegatronModel(NamedTuple):
    """What `build_gpt_model` returns: the model and the configs it was built from."""

    model: GPTModel
    config: TransformerConfig
    layout: convert.Qwen3Layout
    hf_config: dict[str, Any]


def load_hf_state(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the HF safetensors files in model_dir, cast to dtype."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                state[name] = f.get_tensor(name).to(dtype)
    return state


def _check_initialised(parallel: ParallelSettings, device: str) -> None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or (device == "cpu" and not cpu_compat.enabled()):
        # (Re)build the groups; on CPU this also (re)installs the patches and the RNG tracker, which
        # someone's `cpu_compat.disable()` may have removed while the groups lived on.
        init_parallel(parallel, device)
        return
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())
    if have != (parallel.tp, parallel.pp, parallel.ep):
        raise ValueError(f"megatron groups are initialised as tp/pp/ep={have}, the job asks {parallel}")


def build_gpt_model(hf_model_dir: str | Path, parallel: ParallelSettings, device: str = "cpu",
                    dtype: torch.dtype = torch.float32, parallel_output: bool = False) -> MegatronModel:
    """This rank's frozen GPTModel (eval mode) holding the HF weights; initialises single-process groups if none exist.

    ``parallel_output=False`` makes forward return logits gathered over the full (padded) vocabulary;
    True leaves each TP rank its vocabulary shard (for vocab-parallel log-probs).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    hf_config = convert.read_hf_config(hf_model_dir)
    layout = convert.layout_from_hf(hf_config)
    parallel.check_model(num_layers=layout.num_layers, num_heads=layout.num_heads,
                         num_kv_heads=layout.num_kv_heads, num_experts=layout.num_experts)
    _check_initialised(parallel, device)
    cpu_compat.patch_missing_transformer_engine()
    config = convert.transformer_config(layout, parallel, dtype, device.split(":")[0])
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                          normalization="RMSNorm"),
        vocab_size=convert.padded_vocab_size(layout.vocab_size, parallel.tp),
        max_sequence_length=layout.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=parallel_output, share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope", rotary_base=layout.rope_theta,
    )
    full = convert.hf_to_megatron(load_hf_state(hf_model_dir, dtype), layout)
    shard = convert.shard_state(full, layout, convert.RankCoords.current())
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if own != shard.keys():
        raise RuntimeError(f"megatron model and converted checkpoint disagree: model-only "
                           f"{sorted(own - shard.keys())[:5]}, checkpoint-only {sorted(shard.keys() - own)[:5]}")
    model.load_state_dict(shard, strict=False)
    model.to(device)
    model.requires_grad_(False)
    set_training(model, False)
    return MegatronModel(model, config, layout, hf_config)


def set_training(model: GPTModel, training: bool) -> None:
    """model.train(training), except MoE layers stay in eval mode when tp > 1.

    megatron's MoELayer refuses to run in training mode with tp > 1 unless sequence parallelism is
    on, and sequence parallelism needs norms the local spec lacks (torch norms assert it off). With
    no aux loss, no jitter and dropout 0 a MoE layer computes the same in eval mode, and autograd
    does not depend on the mode, so gradients are unchanged.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer

    model.train(training)
    if training and ps.get_tensor_model_parallel_world_size() > 1:
        for module in model.modules():
            if isinstance(module, MoELayer):
                module.eval()


def causal_inputs(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [b, s], attention_mask [1, 1, s, s]) for GPTModel.forward; mask True = not attended."""
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    mask = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(diagonal=1)
    return position_ids, mask.view(1, 1, s, s)


def _forward_step(loss_func: Callable[[torch.Tensor], Any]) -> Callable[..., tuple[torch.Tensor, Callable]]:
    """A megatron ``forward_step_func``: the next ids from the iterator through this stage, then ``loss_func``."""

    def forward_step(batch: Iterator[torch.Tensor], module: GPTModel) -> tuple[torch.Tensor, Callable]:
        ids = next(batch)
        position_ids, mask = causal_inputs(ids)
        return module(input_ids=ids, position_ids=position_ids, attention_mask=mask), loss_func

    return forward_step


def compute_logits(model: GPTModel, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Causal-LM logits [b, s, vocab_size] of a batch of token ids (right padding is harmless: causal).

    Needs a model built with parallel_output=False; padded vocabulary columns are sliced off. With
    pp > 1 every stage must call it (megatron's forward-only pipeline schedule, one micro-batch) and
    only the last stage gets the logits, the others None. No autograd graph is kept across stages.
    """
    if model.pre_process and model.post_process:
        position_ids, mask = causal_inputs(input_ids)
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)[..., :vocab_size]
    from megatron.core.pipeline_parallel import get_forward_backward_func

    collected = get_forward_backward_func()(
        forward_step_func=_forward_step(lambda output, non_loss_data=True: output), data_iterator=iter([input_ids]),
        model=[model], num_microbatches=1, seq_length=input_ids.shape[1], micro_batch_size=input_ids.shape[0],
        forward_only=True, collect_non_loss_data=True)
    return collected[0][..., :vocab_size] if model.post_process else None


def pipeline_backward(model: GPTModel, input_ids: torch.Tensor, vocab_size: int,
                      loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Forward and backward of one micro-batch through every pipeline stage (megatron's 1F1B schedule).

    Every stage calls it with the same ids; on the last stage ``loss_fn(logits [b, s, vocab_size])``
    gives the scalar to backpropagate, and gradients reach every stage's parameters through the
    schedule's send/recv. One micro-batch per call, so megatron's division by the micro-batch count
    is a division by 1: the caller's loss scaling is kept exactly.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return loss_fn(output[..., :vocab_size]), {}

    get_forward_backward_func()(
        forward_step_func=_forward_step(loss_func), data_iterator=iter([input_ids]), model=[model],
        num_microbatches=1, seq_length=input_ids.shape[1], micro_batch_size=input_ids.shape[0], forward_only=False)
