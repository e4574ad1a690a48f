"""Payload checks against the served model, completion from the pristine base, config rules, sampling."""

from __future__ import annotations

import pytest
import torch

from lorarl.common.config import ConfigError, from_dict
from lorarl.common.errors import FailedPreconditionError
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.hf_engine import choose_token
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.payloads import check_adapter, check_merged, complete_weights
from lorarl.rollout.schema import Sampling
from tests.unit.rollout.models import LORA, dense_model_dir, random_adapter


@pytest.fixture(scope="module")
def files() -> ModelFiles:
    return ModelFiles(dense_model_dir())


def test_model_files_read_headers_and_fingerprint(files: ModelFiles) -> None:
    from lorarl.contract.fingerprint import base_model_fingerprint

    assert files.architecture == "Qwen3ForCausalLM" and not files.is_moe and files.tie_word_embeddings
    assert files.shape("model.embed_tokens.weight") == (files.vocab_size, 128)
    assert files.eos_token_ids == (258,)
    assert files.fingerprint() == base_model_fingerprint(files.root)


def test_merged_payloads_are_checked_and_completed_from_the_base(files: ModelFiles) -> None:
    norm = files.tensor("model.norm.weight") * 2
    check_merged({"model.norm.weight": norm, "lm_head.weight": torch.zeros(1)}, files)  # tied lm_head ignored
    with pytest.raises(FailedPreconditionError, match="not a weight"):
        check_merged({"model.layers.9.mlp.up_proj.weight": norm}, files)
    with pytest.raises(FailedPreconditionError, match="has shape"):
        check_merged({"model.norm.weight": norm[:-1]}, files)
    full = dict(complete_weights({"model.norm.weight": norm}, files))
    assert sorted(full) == files.weight_names()
    assert torch.equal(full["model.norm.weight"], norm)
    assert torch.equal(full["model.layers.0.mlp.up_proj.weight"], files.tensor("model.layers.0.mlp.up_proj.weight"))


def test_adapter_check_reports_the_modules_it_targets(files: ModelFiles) -> None:
    lora = check_adapter(random_adapter(files.root, targets=("q_proj", "down_proj")), LORA, files, max_rank=16)
    assert lora.target_modules == ("down_proj", "q_proj") and lora.scale == 2.0


def test_settings_rules() -> None:
    assert from_dict(RolloutSettings, {"max_loras": 2}).window == 2
    with pytest.raises(ConfigError, match="adapter_window"):
        from_dict(RolloutSettings, {"max_loras": 2, "adapter_window": 3})
    with pytest.raises(ConfigError, match="max_lora_rank"):
        from_dict(RolloutSettings, {"max_lora_rank": 12})


def test_sampling_like_vllm() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, -1.0])
    token, logprob, top = choose_token(logits, Sampling(temperature=0.0, logprobs=2), None, processed=True)
    assert token == 1 and logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    assert list(top) == [1, 2]
    g = torch.Generator().manual_seed(0)
    drawn = {choose_token(logits, Sampling(temperature=1.0, top_k=2), g, True)[0] for _ in range(200)}
    assert drawn == {1, 2}
    drawn = {choose_token(logits, Sampling(temperature=1.0, top_p=0.5), g, True)[0] for _ in range(50)}
    assert drawn == {1}
