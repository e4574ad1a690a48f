"""A replica merging the adapter locally gets exactly the trainer's merged weights."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lorarl.contract.lora import LoraSpec
from lorarl.trainer.rl.lora import LoraConfig, inject_lora, iter_merged_weights, lora_parameters, peft_state_dict
from lorarl.v1 import common_pb2
from lorarl.weightsync.wire.merge import merged_from_adapter


def tiny(dtype: torch.dtype) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).to(dtype)


def test_local_merge_is_bit_identical_to_the_trainers() -> None:
    for dtype, rslora in [(torch.float32, False), (torch.bfloat16, True)]:
        base = {n: t.clone() for n, t in tiny(dtype).state_dict().items()}
        model = tiny(dtype)
        lora = LoraConfig(rank=4, alpha=8.0, use_rslora=rslora)
        inject_lora(model, lora)
        with torch.no_grad():
            for p in lora_parameters(model):
                p.normal_(0, 0.5)
        spec = common_pb2.LoraSpec(rank=4, alpha=8.0, use_rslora=rslora)
        assert LoraSpec.from_proto(spec).scale == lora.scale
        local = dict(merged_from_adapter(peft_state_dict(model), LoraSpec.from_proto(spec), base.__getitem__))
        trainer = dict(iter_merged_weights(model))
        assert len(local) == 7 * 2
        for name, tensor in local.items():
            assert tensor.dtype == dtype
            assert torch.equal(tensor, trainer[name]), name
