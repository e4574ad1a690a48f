"""What the Ray launcher asks the cluster for, and what it refuses before starting anything."""

from __future__ import annotations

import pytest

from lorarl.client.job.config import load_job_config
from lorarl.client.launch.ray_cluster import check_resources, gcs_address, job_bundles
from lorarl.common.config import ConfigError
from lorarl.rollout.sync import advertised_address


def cfg(*overrides: str):
    return load_job_config("examples/demo.yaml", ["launcher.kind=ray", *overrides])


def test_bundles_carry_devices_per_replica_and_rank_and_custom_resources() -> None:
    b = job_bundles(cfg("trainer.device=cuda", "trainer.parallel.data=2", "rollout.replicas=3",
                        "rollout.tensor_parallel_size=2", 'launcher.rollout_resources={"a100": 1}',
                        'launcher.trainer_resources={"head": 1}'))
    assert b.trainer == {"CPU": 1.0, "head": 1.0, "GPU": 2.0}
    assert b.rollout == {"CPU": 1.0, "a100": 1.0, "GPU": 2.0}
    assert b.total() == {"CPU": 5.0, "head": 1.0, "GPU": 8.0, "a100": 3.0}
    npu = job_bundles(cfg("trainer.device=npu", "model.dtype=bfloat16", "rollout.block_size=128"))
    assert npu.rollout["NPU"] == 1.0 and "GPU" not in npu.rollout
    assert "GPU" not in job_bundles(cfg()).trainer  # a CPU job asks for CPUs only


def test_a_shortfall_names_each_resource_and_the_split() -> None:
    job = cfg("trainer.device=cuda", "rollout.replicas=2", "rollout.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match=r"short of what the job needs: 5 GPU \(trainer 1 \+ rollout 2 x 2\), "
                                          r"the cluster has 4"):
        check_resources(job, job_bundles(job), {"CPU": 64, "GPU": 4}, "head:6379")
    check_resources(job, job_bundles(job), {"CPU": 4, "GPU": 5}, "head:6379")  # enough: no error


def test_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert gcs_address("auto") is None
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert gcs_address("auto") == "10.1.2.3:6379"
    assert gcs_address("ray://h:10001") == "h:10001"
    assert advertised_address("", "127.0.0.1", 5000, "ws:1") == "127.0.0.1:5000"
    assert advertised_address("node7", "0.0.0.0", 5000, "ws:1") == "node7:5000"
    assert advertised_address("node7:6000", "0.0.0.0", 5000, "ws:1") == "node7:6000"
    assert advertised_address("[fd00::1]", "::", 5000, "ws:1") == "[fd00::1]:5000"
    assert advertised_address("", "0.0.0.0", 5000, "127.0.0.1:1") == "127.0.0.1:5000"  # the route to weight sync


def test_a_bundle_no_single_node_holds_is_refused() -> None:
    from lorarl.client.launch.ray_cluster import check_fit

    job = cfg("trainer.device=cuda", "trainer.parallel.data=16", "rollout.replicas=16")
    nodes = [{"CPU": 64, "GPU": 8}] * 4  # 32 GPUs: enough in total, but the trainer's 16 span two nodes
    check_resources(job, job_bundles(job), {"CPU": 256, "GPU": 32}, "head:6379")
    with pytest.raises(ConfigError, match=r"can hold weight sync \+ the trainer \(one node\): it needs .*'GPU': 16"):
        check_fit(job_bundles(job), nodes, "head:6379")
    fine = cfg("trainer.device=cuda", "trainer.parallel.data=8", "rollout.replicas=8")
    check_fit(job_bundles(fine), nodes, "head:6379")
