"""The lorarl.v1 contracts: lint, breaking-change checks, fresh generated code, round trips."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from lorarl.v1 import common_pb2, rollout_pb2, trainer_pb2, weightsync_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
BUF = ROOT / "tools" / "buf" / "node_modules" / ".bin" / "buf"
BASELINE = PROTOS / "baseline" / "lorarl-v1.binpb"

needs_buf = pytest.mark.skipif(not BUF.exists(), reason="buf not installed (run `make setup`)")


def run_buf(*args: str, cwd: Path = PROTOS) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_buf
def test_buf_lint_passes() -> None:
    result = run_buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_buf
def test_no_breaking_change_against_released_baseline() -> None:
    result = run_buf("breaking", "--against", str(BASELINE))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_buf
def test_no_breaking_change_against_last_commit() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "ls-tree", "HEAD", "protos/lorarl"], cwd=ROOT, capture_output=True, text=True)
    if not head.stdout.strip():
        pytest.skip("no committed contracts yet")
    result = run_buf("breaking", "--against", f"{ROOT / '.git'}#ref=HEAD,subdir=protos")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_buf
def test_breaking_check_catches_a_removed_field(tmp_path: Path) -> None:
    copy = tmp_path / "protos"
    shutil.copytree(PROTOS, copy)
    common = copy / "lorarl" / "v1" / "common.proto"
    text = common.read_text()
    assert "  string group_id = 3;\n" in text
    common.write_text(text.replace("  string group_id = 3;\n", ""))
    result = run_buf("breaking", "--against", str(BASELINE), cwd=copy)
    assert result.returncode != 0
    assert "group_id" in result.stdout + result.stderr


def test_generated_code_is_fresh() -> None:
    from tools.gen_protos import stale_files

    assert stale_files() == [], "generated code is stale: run `make proto`"


def test_trajectory_round_trip() -> None:
    traj = common_pb2.Trajectory(
        id="t1",
        job_id="job",
        group_id="g0",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        behavior_logprobs=[-0.5, -1.25],
        token_versions=[3, 4],
        reward=1.0,
        rewards={"correct": 1.0},
        finish_reason=common_pb2.FINISH_REASON_STOP,
        metrics={"latency_s": 0.5},
    )
    back = common_pb2.Trajectory.FromString(traj.SerializeToString())
    assert back == traj
    assert list(back.token_versions) == [3, 4]
    assert back.behavior_logprobs[1] == pytest.approx(-1.25)


def test_manifest_round_trip_with_collective_transport() -> None:
    manifest = common_pb2.WeightManifest(
        job_id="job",
        version=7,
        mode=common_pb2.SYNC_MODE_ADAPTER,
        base_model_fingerprint="abc",
        lora=common_pb2.LoraSpec(rank=16, alpha=32, target_modules=["all-linear"],
                                 expert_mode=common_pb2.EXPERT_ADAPTER_MODE_PER_EXPERT, use_rslora=True),
        tensors=[common_pb2.TensorSpec(name="a", shape=[16, 128], dtype=common_pb2.D_TYPE_FLOAT32,
                                       bucket=0, offset=0, nbytes=8192, checksum=123)],
        buckets=[common_pb2.Bucket(index=0, nbytes=8192, checksum=9)],
        total_bytes=8192,
        transport=common_pb2.Transport(collective=common_pb2.CollectiveTransport(
            backend=common_pb2.COLLECTIVE_BACKEND_GLOO, master_address="127.0.0.1", master_port=29500,
            group_name="ws-job-7", world_size=2, source_rank=0, replica_ranks={"r0": 1})),
        checksum_algorithm="xxh64",
    )
    back = common_pb2.WeightManifest.FromString(manifest.SerializeToString())
    assert back == manifest
    assert back.transport.WhichOneof("kind") == "collective"
    assert back.transport.collective.replica_ranks["r0"] == 1


def test_service_messages_round_trip() -> None:
    req = trainer_pb2.CreateJobRequest(job_id="j", config=trainer_pb2.JobConfig(
        base_model_path="/m", loss=trainer_pb2.LossConfig(type=trainer_pb2.LOSS_TYPE_DAPO, clip_eps_high=0.28)))
    assert trainer_pb2.CreateJobRequest.FromString(req.SerializeToString()) == req
    gen = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[1, 2])],
                                      sampling=common_pb2.SamplingParams(n=4, temperature=1.0, seed=3),
                                      policy=rollout_pb2.PolicySelector(job_id="j", version=2))
    back = rollout_pb2.GenerateRequest.FromString(gen.SerializeToString())
    assert back.sampling.HasField("seed") and back.sampling.seed == 3
    event = weightsync_pb2.SubscribeResponse(commit=weightsync_pb2.CommitEvent(job_id="j", version=5))
    assert weightsync_pb2.SubscribeResponse.FromString(event.SerializeToString()).WhichOneof("event") == "commit"
