"""Per-job Prometheus series of a trainer: what `lorarl jobs` shows, scraped (lorarl_trainer_job_*{job_id}).

A collector read at scrape time from the JobManager, so a deleted job's series go with it and nothing is
updated on the training path but three counters per pass (Job.trained_tokens, _passes, _seconds) and the
last pass's rollout-vs-trainer monitor (Job.rollout_kl_k3, _masked_token_fraction).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lorarl.trainer.service.jobs import JobManager


class JobsCollector(Collector):
    def __init__(self, jobs: JobManager) -> None:
        self.jobs = jobs

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["job_id"]
        version = GaugeMetricFamily("lorarl_trainer_job_version", "The job's policy version.", labels=labels)
        step = GaugeMetricFamily("lorarl_trainer_job_step", "Optimiser steps the job has taken.", labels=labels)
        buffered = GaugeMetricFamily("lorarl_trainer_job_buffered_trajectories",
                                     "Trajectories pushed and not yet trained on.", labels=labels)
        job_bytes = GaugeMetricFamily("lorarl_trainer_job_bytes", "The job's own memory: adapter, gradients, "
                                      "optimizer moments (the base is counted once, in base_bytes).", labels=labels)
        base_bytes = GaugeMetricFamily("lorarl_trainer_job_base_bytes", "The job's base model (shared).",
                                       labels=labels)
        base_jobs = GaugeMetricFamily("lorarl_trainer_job_base_jobs", "Jobs sharing the job's base.", labels=labels)
        tokens = CounterMetricFamily("lorarl_trainer_job_trained_tokens", "Completion tokens trained on.",
                                     labels=labels)
        passes = CounterMetricFamily("lorarl_trainer_job_training_passes", "forward_backward / train_step passes.",
                                     labels=labels)
        seconds = CounterMetricFamily("lorarl_trainer_job_training_seconds",
                                      "Seconds of those passes in the engine thread.", labels=labels)
        rollout_kl = GaugeMetricFamily("lorarl_trainer_job_rollout_kl", "KL(rollout || trainer) of the last pass's "
                                       "tokens, k3 estimate: how far the sampler was from the trainer's policy.",
                                       labels=labels)
        masked = GaugeMetricFamily("lorarl_trainer_job_rollout_masked_token_fraction", "Tokens of the last pass "
                                   "that rollout correction rejected.", labels=labels)
        flagged = CounterMetricFamily("lorarl_trainer_job_fingerprint_mismatches", "Trajectories accepted whose "
                                      "weights fingerprint for a version is not the one published (fingerprint_check "
                                      "'flag').", labels=labels)
        for job in self.jobs.list():
            key = [job.job_id]
            version.add_metric(key, job.engine.version)
            step.add_metric(key, job.engine.step)
            buffered.add_metric(key, len(job.buffer))
            shared, sharing, own = job.engine.memory()
            job_bytes.add_metric(key, own)
            base_bytes.add_metric(key, shared)
            base_jobs.add_metric(key, sharing)
            tokens.add_metric(key, job.trained_tokens)
            passes.add_metric(key, job.trained_passes)
            seconds.add_metric(key, job.trained_seconds)
            rollout_kl.add_metric(key, job.rollout_kl_k3)
            masked.add_metric(key, job.rollout_masked_token_fraction)
            flagged.add_metric(key, job.buffer.fingerprints.flagged)
        yield from (version, step, buffered, job_bytes, base_bytes, base_jobs, tokens, passes, seconds, rollout_kl,
                    masked, flagged)
