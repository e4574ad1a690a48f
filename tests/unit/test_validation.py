"""Checks on outside inputs: ids, versions, paths, finite numbers, quoting, and lazily reserved transfers."""

from __future__ import annotations

import math

import pytest

from lorarl.common.errors import InvalidArgumentError
from lorarl.common.validation import QUOTE_CHARS, check_finite, check_id, check_path, check_version, quote
from lorarl.contract.ids import MAX_VERSION
from lorarl.contract.lora import MAX_RANK, LoraSpec
from lorarl.trainer.engines.api import OptimizerSpec
from lorarl.trainer.rl.losses import LossSpec
from lorarl.v1 import common_pb2
from lorarl.weightsync.wire.inline import BucketAssembler
from lorarl.weightsync.wire.payload import PayloadError
from tests.unit.weightsync.fixtures import adapter, manifest_of


@pytest.mark.parametrize("bad", ["", "a/b", "job\nid", "-lead", "x" * 129, "nul\x00", "sp ace"])
def test_ids_are_a_safe_file_name(bad: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        check_id("job_id", bad)
    assert raised.value.field == "job_id" and len(str(raised.value)) < 2 * QUOTE_CHARS + 200
    assert check_id("job_id", "demo-1.run_2") == "demo-1.run_2"


def test_a_long_input_is_quoted_cut_short() -> None:
    text = quote("x" * 10_000_000)
    assert len(text) < QUOTE_CHARS + 40 and text.endswith("(10000000 characters)")
    assert quote("short") == "'short'"


def test_versions_paths_and_numbers_have_bounds() -> None:
    assert check_version("v", MAX_VERSION) == MAX_VERSION
    with pytest.raises(InvalidArgumentError, match=str(MAX_VERSION)):
        check_version("v", MAX_VERSION + 1)
    with pytest.raises(InvalidArgumentError, match="NUL"):
        check_path("path", "a\x00b")
    with pytest.raises(InvalidArgumentError, match="at most 4096"):
        check_path("path", "a" * 4097)
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(InvalidArgumentError, match="finite"):
            check_finite("x", value)


@pytest.mark.parametrize("kwargs", [{"rank": MAX_RANK + 1}, {"rank": 2**32 - 1}, {"alpha": math.nan},
                                    {"alpha": math.inf}, {"dropout": math.nan},
                                    {"target_modules": tuple(f"m{i}" for i in range(65))}])
def test_a_lora_spec_refuses_what_cannot_be_meant(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="lora"):
        LoraSpec(**kwargs)


@pytest.mark.parametrize("name", ["clip_eps_low", "clip_eps_high", "kl_coef", "entropy_coef", "behavior_weight_cap"])
def test_loss_settings_refuse_non_finite_numbers(name: str) -> None:
    with pytest.raises(ValueError, match=f"loss.{name} must be a finite number"):
        LossSpec(**{name: math.nan})


@pytest.mark.parametrize("name", ["learning_rate", "weight_decay", "beta1", "eps", "max_grad_norm"])
def test_optimizer_settings_refuse_non_finite_numbers(name: str) -> None:
    with pytest.raises(ValueError, match=f"optimizer.{name} must be a finite number"):
        OptimizerSpec(**{name: math.inf})


def test_a_transfer_reserves_memory_only_as_bytes_arrive_and_up_to_a_limit() -> None:
    manifest, _ = manifest_of(adapter(), bucket_bytes=600)
    with pytest.raises(PayloadError, match="at most 100"):
        BucketAssembler(manifest, max_bytes=100)
    huge = type(manifest)()
    huge.CopyFrom(manifest)
    huge.buckets[0].nbytes = 1 << 40  # a declared terabyte: nothing is allocated for it up front
    assembler = BucketAssembler(huge)
    assert all(b is None for b in assembler.buffers)
    with pytest.raises(PayloadError, match="overflows"):
        assembler.add(common_pb2.WeightChunk(bucket=1, offset=0, data=b"\0" * (10 << 20)))  # bucket 1 is small
    assert all(b is None for b in assembler.buffers)  # still nothing reserved for the terabyte
    small = BucketAssembler(manifest)
    small.add(common_pb2.WeightChunk(bucket=1, offset=0, data=b"\1" * 8))
    assert small.buffers[0] is None and small.buffers[1] is not None  # the bucket that got bytes, only


@pytest.mark.parametrize(("job_id", "version"), [("../../x", 1), ("/tmp/x", 1), ("job\nid", 1), ("ok", 0)])
def test_load_weights_refuses_a_job_id_or_version_that_could_name_a_file_badly(job_id: str, version: int) -> None:
    """The rollout names adapters (and their shm files) after the manifest's job and version."""
    import asyncio

    from lorarl.rollout.loading import receive
    from lorarl.v1 import rollout_pb2

    manifest, _ = manifest_of(adapter(), job_id="ok")
    manifest.job_id, manifest.version = job_id, version

    async def stream():
        yield rollout_pb2.LoadWeightsRequest(manifest=manifest)

    with pytest.raises(InvalidArgumentError) as raised:
        asyncio.run(receive(stream()))
    assert raised.value.field in ("manifest.job_id", "manifest.version", "manifest")
