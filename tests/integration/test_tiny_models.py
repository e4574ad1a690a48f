"""The shipped tiny policies: they load, they leave room for RL, and vLLM serves them exactly as
transformers computes them (fp32 greedy, token for token), LoRA adapters included."""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorarl.assets import ASSETS_DIR, DENSE_MODEL_DIR, MOE_MODEL_DIR, load_split
from lorarl.assets.evaluate import MAX_NEW_TOKENS, evaluate_greedy, generate_token_ids, pass_at_k
from lorarl.assets.paths import MIXED_MODEL_DIR, TOOLS_MODEL_DIR
from lorarl.assets.tasks import extract_answer
from lorarl.assets.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE, load_tokenizer, prompt_token_ids

MODEL_DIRS = {"dense": DENSE_MODEL_DIR, "moe": MOE_MODEL_DIR}
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _load(model_dir: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def dense() -> Any:
    return _load(DENSE_MODEL_DIR)


@pytest.fixture(scope="module")
def moe() -> Any:
    return _load(MOE_MODEL_DIR)


@pytest.fixture(scope="module")
def test_prompt_ids() -> list[list[int]]:
    tokenizer = load_tokenizer(DENSE_MODEL_DIR)
    return [prompt_token_ids(tokenizer, p.prompt) for p in load_split("test")]


# ------------------------------------------------------------------------------------------ transformers


@pytest.mark.parametrize("name", ["dense", "moe", "tools", "mixed"])
def test_model_dirs_are_complete_fp32_safetensors(name):
    model_dir = {**MODEL_DIRS, "tools": TOOLS_MODEL_DIR, "mixed": MIXED_MODEL_DIR}[name]
    for file in MODEL_FILES:
        assert (model_dir / file).is_file(), file
    assert not list(model_dir.glob("*.bin")), "weights must be safetensors only"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert config["vocab_size"] == VOCAB_SIZE
    assert config["eos_token_id"] == EOS_TOKEN_ID
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_TOKEN_ID
    assert not {"temperature", "top_p", "top_k", "do_sample"} & set(generation), "no sampling defaults"


def test_dense_and_moe_architectures(dense, moe):
    assert type(dense).__name__ == "Qwen3ForCausalLM"
    assert type(moe).__name__ == "Qwen3MoeForCausalLM"
    assert dense.config.num_key_value_heads < dense.config.num_attention_heads  # GQA
    assert moe.config.num_experts >= 4 and moe.config.num_experts_per_tok == 2
    for model in (dense, moe):
        assert sum(p.numel() for p in model.parameters()) < 5_000_000
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_shipped_assets_fit_the_size_budget():
    total = sum(f.stat().st_size for f in ASSETS_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    assert total <= 30 * 1024 * 1024, f"lorarl/assets/ holds {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_accuracy_leaves_room_for_rl(name, dense, moe):
    model = {"dense": dense, "moe": moe}[name]
    result = evaluate_greedy(model, "test")
    assert 0.10 <= result.accuracy <= 0.60, result.accuracy
    # The format is already right: every greedy completion is a well-formed answer.
    assert all(extract_answer(c) is not None for c in result.completions)
    info = json.loads((MODEL_DIRS[name] / "build_info.json").read_text())
    assert result.accuracy == pytest.approx(info["test_greedy_accuracy"], abs=0.02), "differs from build"


def test_greedy_completions_end_with_eos(dense, test_prompt_ids):
    completions = generate_token_ids(dense, test_prompt_ids[:64])
    assert all(c and c[-1] == EOS_TOKEN_ID and len(c) <= MAX_NEW_TOKENS for c in completions)


def test_sampling_finds_right_answers_often(dense):
    """What GRPO needs: at T=1 most problems get at least one right answer in 8 samples."""
    result = pass_at_k(dense, "test", k=8, temperature=1.0, seed=0, limit=150)
    assert result["pass@8"] >= 0.7, result
    assert result["eos_rate"] >= 0.98, result


# ----------------------------------------------------------------------------------------------- vLLM

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@contextmanager
def _vllm_engine(model_dir: Path, **kwargs: Any) -> Iterator[Any]:
    """An in-process fp32 engine, dropped on exit so the next test can start its own."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=256, **kwargs)
    try:
        yield llm
    finally:
        del llm
        gc.collect()


def _vllm_greedy(llm: Any, prompt_ids: Sequence[Sequence[int]], lora_request: Any = None) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate(
        [{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, lora_request=lora_request, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def _assert_same_tokens(expected: list[list[int]], actual: list[list[int]]) -> None:
    mismatches = [i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a != b]
    assert not mismatches, f"{len(mismatches)} prompts differ, e.g. #{mismatches[0]}: " + (
        f"transformers {expected[mismatches[0]]} vs vLLM {actual[mismatches[0]]}"
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_vllm_greedy_matches_transformers(name, dense, moe, test_prompt_ids):
    model = {"dense": dense, "moe": moe}[name]
    expected = generate_token_ids(model, test_prompt_ids)
    with _vllm_engine(MODEL_DIRS[name]) as llm:
        _assert_same_tokens(expected, _vllm_greedy(llm, test_prompt_ids))
        # The chat path renders the prompt with the shipped template to the same ids.
        chat = llm.chat([[{"role": "user", "content": load_split("test")[0].prompt}]], use_tqdm=False)
        assert list(chat[0].prompt_token_ids) == test_prompt_ids[0]


@pytest.fixture(scope="module")
def random_adapter(tmp_path_factory) -> tuple[Path, Any]:
    """A nonzero rank-8 PEFT adapter on every linear layer of the dense policy, saved to disk."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1234)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(_load(DENSE_MODEL_DIR), config)
    peft_model.eval()
    path = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(str(path))
    return path, peft_model


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_lora_matches_transformers_peft(random_adapter, dense, test_prompt_ids):
    from vllm.lora.request import LoRARequest

    adapter_dir, peft_model = random_adapter
    prompts = test_prompt_ids[:96]
    expected_base = generate_token_ids(dense, prompts)
    expected_lora = generate_token_ids(peft_model, prompts)
    assert expected_lora != expected_base, "the adapter must change some outputs for this test to mean anything"
    with _vllm_engine(DENSE_MODEL_DIR, enable_lora=True, max_lora_rank=16, max_loras=1) as llm:
        _assert_same_tokens(expected_lora, _vllm_greedy(llm, prompts, LoRARequest("random", 1, str(adapter_dir))))
        _assert_same_tokens(expected_base, _vllm_greedy(llm, prompts))
