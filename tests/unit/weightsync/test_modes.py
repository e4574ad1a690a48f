"""AUTO resolves to adapter only when every replica can load it; the reason names who blocks it."""

from __future__ import annotations

from lorarl.v1 import common_pb2
from lorarl.weightsync.service.modes import (
    ADAPTER,
    AUTO,
    MERGED,
    choose_mode,
    registration_refusal,
    serve_mode,
    sharing_blocker,
)
from tests.unit.weightsync.fixtures import caps, lora_spec


def test_explicit_modes_are_kept() -> None:
    assert choose_mode(ADAPTER, lora_spec(), {"r": caps(lora=False)}).mode == ADAPTER
    assert choose_mode(MERGED, lora_spec(), {"r": caps()}).mode == MERGED


def test_auto_with_lora_capable_replicas_is_adapter() -> None:
    choice = choose_mode(AUTO, lora_spec(rank=16), {"a": caps(rank=16), "b": caps(rank=64)})
    assert choice.mode == ADAPTER
    assert "all 2 replicas serve LoRA rank 16" in choice.reason


def test_auto_with_moe_on_vllm_cpu_is_merged_and_says_why() -> None:
    replicas = {"dense": caps(), "moe": caps(lora=False, engine="vllm-cpu")}
    choice = choose_mode(AUTO, lora_spec(), replicas)
    assert choice.mode == MERGED
    assert "moe: engine (vllm-cpu) does not support LoRA (supports_lora=false)" in choice.reason
    assert "dense" not in choice.reason


def test_auto_rank_and_slots_matter() -> None:
    assert "max_lora_rank 8 < rank 16" in choose_mode(AUTO, lora_spec(rank=16), {"r": caps(rank=8)}).reason
    assert "max_loras is 0" in choose_mode(AUTO, lora_spec(), {"r": caps(loras=0)}).reason


def test_auto_without_replicas_defaults_to_adapter() -> None:
    choice = choose_mode(AUTO, lora_spec(), {})
    assert choice.mode == ADAPTER and "no replica" in choice.reason


def test_serve_mode_merges_locally_where_lora_cannot_run() -> None:
    assert serve_mode(ADAPTER, caps(), lora_spec()) == ADAPTER
    assert serve_mode(ADAPTER, caps(lora=False), lora_spec()) == MERGED
    assert serve_mode(MERGED, caps(), lora_spec()) == MERGED
    assert common_pb2.SYNC_MODE_AUTO == AUTO


def shared(**kw: object):
    c = caps(**kw)  # type: ignore[arg-type]
    c.shared = True
    return c


def test_a_shared_replica_is_never_given_what_would_write_its_base() -> None:
    """Several jobs sample from a shared replica: an adapter above its rank, any adapter where it has no LoRA, and
    a merged job are refused at registration, naming the rank, the limit and the setting; a single-job replica
    still merges locally."""
    assert registration_refusal(AUTO, lora_spec(rank=32), {"a": shared(rank=64)}) is None
    why = registration_refusal(AUTO, lora_spec(rank=32), {"a": caps(rank=64), "b": shared(rank=16)})
    assert why is not None and "rollout.max_lora_rank=32 or more" in why
    assert why.startswith("replica b: LoRA rank 32 is above the rank this shared rollout serves "
                          "(rollout.max_lora_rank=16)")
    assert "does not support LoRA" in registration_refusal(ADAPTER, lora_spec(), {"b": shared(lora=False)})
    assert "adapter mode only" in registration_refusal(MERGED, lora_spec(), {"b": shared()})
    assert sharing_blocker(caps(lora=False), ADAPTER, lora_spec()) is None  # one job's replica: merged locally
    assert serve_mode(ADAPTER, caps(lora=False), lora_spec()) == MERGED
    assert sharing_blocker(shared(rank=8), ADAPTER, lora_spec(rank=16)) is not None
