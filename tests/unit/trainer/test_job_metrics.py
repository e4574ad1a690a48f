"""The trainer's per-job Prometheus series (job_metrics.py): one series per live job, read at scrape time."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lorarl.trainer.engines.api import TrainingSpec, TrajectoryRecord
from lorarl.trainer.service.config import TrainerSettings
from lorarl.trainer.service.jobs import JobManager
from lorarl.trainer.service.server import TrainerServicer, job_metrics


class CountingEngine:
    """Trains nothing; reports the tokens it was given and a shared base, as TorchEngine does."""

    vocab_size = 100

    def __init__(self) -> None:
        self.version = self.step = 0

    def memory(self) -> tuple[int, int, int]:
        return (1000, 2, 30)

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    def train_step(self, batch: list[TrajectoryRecord]) -> dict[str, float]:
        self.version, self.step = self.version + 1, self.step + 1
        return {"loss": 0.0, "tokens": float(sum(len(r.completion_token_ids) for r in batch)),
                "rollout_kl_k3": 0.0125, "rollout_masked_token_fraction": 0.25}


def samples(registry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("job_id", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_each_live_job_has_its_series_and_a_deleted_job_loses_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    manager = JobManager(engine_factory=lambda s: CountingEngine())
    metrics = job_metrics(TrainerServicer(TrainerSettings(), jobs=manager))
    record = TrajectoryRecord([1, 2], [3, 4, 5], [-1.0] * 3, [0] * 3, 1.0, "g")

    async def body() -> None:
        for job_id in ("a", "b"):
            await manager.create(job_id, TrainingSpec(base_model_path=str(tmp_path)))
        manager.push("a", [record, record])
        manager.push("b", [record])
        before = samples(metrics.registry)
        assert before[("lorarl_trainer_job_buffered_trajectories", "a")] == 2
        assert before[("lorarl_trainer_job_buffered_trajectories", "b")] == 1
        await manager.train_step("a", 0, [])
        after = samples(metrics.registry)
        assert after[("lorarl_trainer_job_version", "a")] == 1 and after[("lorarl_trainer_job_version", "b")] == 0
        assert after[("lorarl_trainer_job_trained_tokens_total", "a")] == 6  # two trajectories of 3 tokens
        assert after[("lorarl_trainer_job_training_passes_total", "a")] == 1
        assert after[("lorarl_trainer_job_training_passes_total", "b")] == 0
        assert after[("lorarl_trainer_job_training_seconds_total", "a")] > 0 == after[
            ("lorarl_trainer_job_training_seconds_total", "b")]
        job = manager.get("a")
        assert job.tokens_per_second == job.trained_tokens / job.trained_seconds > 0
        assert after[("lorarl_trainer_job_buffered_trajectories", "a")] == 0
        assert after[("lorarl_trainer_job_base_bytes", "a")] == 1000
        assert after[("lorarl_trainer_job_base_jobs", "b")] == 2 and after[("lorarl_trainer_job_bytes", "b")] == 30
        assert after[("lorarl_trainer_job_rollout_kl", "a")] == 0.0125  # the last pass's monitor
        assert after[("lorarl_trainer_job_rollout_masked_token_fraction", "a")] == 0.25
        assert after[("lorarl_trainer_job_rollout_kl", "b")] == 0.0
        await manager.delete("a")
        gone = samples(metrics.registry)
        assert not [k for k in gone if k[1] == "a"] and ("lorarl_trainer_job_version", "b") in gone

    try:
        asyncio.run(body())
    finally:
        gc.unfreeze()
