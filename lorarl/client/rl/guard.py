"""The served-policy guard: once a version serves, each rollout replica's logprobs of a fixed probe under it must be
the trainer's own for that version.

The worst RL failures with LoRA are silent: a rollout that keeps serving the old adapter because the new one
never reached the serving layer (ART #661), requests that lack their adapter and run on the base (verl #5220),
a sync that pushed no adapter at all (verl #7495), a module of the adapter dropped on the way (vLLM #51594's
lm_head). Each shows as the rollout's logprobs not being the trainer's. So for every ``every``-th version:

    at publish      the trainer scores the probe (its prompt + completion) with the version it just made
                    (ComputeLogprobs: the trainer holds that version until its next step)
    once it serves  every replica scores the same tokens pinned to that version (Generate, prompt_logprobs)
    compare         mean |rollout - trainer| over the probe's completion tokens; above ``tolerance`` the
                    version fails (``action: fail``, the default: the run stops naming replica and version)
                    or is flagged (``warn``: a log line and ``policy/guard_alarm``)

The figure also reads the base model's score of the probe (adapters off): a replica whose probe is the base's,
within the tolerance, is named as serving the base. The probe is the job's first held-out example, its prompt as
the job renders it and its answer as the completion.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from lorarl.client.calls import ServiceCallError
from lorarl.client.job.config import PolicyGuardSection
from lorarl.v1 import common_pb2, rollout_pb2, trainer_pb2

logger = logging.getLogger(__name__)


class PolicyGuardError(RuntimeError):
    """A replica serves a version whose probe logprobs are not the trainer's (``action: fail``)."""


@dataclass
class Probe:
    """The fixed sequence every version is scored on: prompt ids and completion ids (at least one)."""

    prompt: list[int]
    completion: list[int]

    def trajectory(self) -> common_pb2.Trajectory:
        n = len(self.completion)
        return common_pb2.Trajectory(prompt_token_ids=self.prompt, completion_token_ids=self.completion,
                                     behavior_logprobs=[0.0] * n, token_versions=[0] * n)


@dataclass
class Verdict:
    version: int
    replica: str
    diff: float  # mean |rollout - trainer| on the probe's completion tokens
    base_diff: float  # mean |rollout - base model|


@dataclass
class PolicyGuard:
    settings: PolicyGuardSection
    probe: Probe
    expected: dict[int, list[float]] = field(default_factory=dict)
    base: list[float] | None = None
    last: Verdict | None = None
    unserved: str = ""  # why the replicas cannot score a probe (an engine without prompt logprobs): off, said once

    def due(self, version: int) -> bool:
        return (bool(self.settings.every) and not self.unserved and version > 0
                and version % self.settings.every == 0)

    async def expect(self, trainer: Any, job_id: str, version: int) -> None:
        """The trainer's own probe logprobs for ``version`` (call while it holds that version), and once the
        base model's."""
        if not self.due(version):
            return
        request = trainer_pb2.ComputeLogprobsRequest(job_id=job_id, trajectories=[self.probe.trajectory()])
        if self.base is None:
            reference = trainer_pb2.ComputeLogprobsRequest(job_id=job_id, trajectories=[self.probe.trajectory()],
                                                           reference=True)
            self.base = list((await trainer.ComputeLogprobs(reference)).results[0].logprobs)
        self.expected[version] = list((await trainer.ComputeLogprobs(request)).results[0].logprobs)
        for old in [v for v in self.expected if v < version]:
            del self.expected[old]

    async def check(self, replicas: list[tuple[str, Any]], job_id: str, version: int) -> list[Verdict]:
        """Every replica's probe under ``version`` against the trainer's; raises with ``action: fail``."""
        expected = self.expected.pop(version, None)
        if expected is None:
            return []
        sequence = self.probe.prompt + self.probe.completion
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=sequence)],
            sampling=common_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=True),
            request_id=f"{job_id}-policy-guard-v{version}")  # jobs on one rollout: ids of their own
        request.policy.CopyFrom(rollout_pb2.PolicySelector(job_id=job_id, version=version))
        verdicts = []
        for name, stub in replicas:
            try:
                response = await stub.Generate(request)
            except ServiceCallError as e:
                if e.code == grpc.StatusCode.NOT_FOUND:
                    # it does not serve this version (yet): a replica that has not caught up after weight sync
                    # restarted, when the version went live on no replicas. Nothing it serves is wrong; its
                    # requests for the version fall back to the job's latest (lorarl.client.workflow.context)
                    logger.info("policy guard: replica %s does not serve %s v%d; not probed (%s)", name, job_id,
                                version, e.details)
                    continue
                if e.code != grpc.StatusCode.FAILED_PRECONDITION or "prompt_logprobs" not in e.details:
                    raise
                self.unserved = e.details
                logger.warning("policy guard off: replica %s cannot score its probe (%s)", name, e.details)
                return verdicts
            served = list(response.results[0].prompt_logprobs)[len(self.probe.prompt):]
            verdicts.append(Verdict(version, name, mean_abs(served, expected), mean_abs(served, self.base or expected)))
        if verdicts:
            self.last = max(verdicts, key=lambda v: v.diff)
        for verdict in verdicts:
            if verdict.diff > self.settings.tolerance:
                self._alarm(verdict, len(expected))
        return verdicts

    def _alarm(self, verdict: Verdict, tokens: int) -> None:
        tolerance = self.settings.tolerance
        why = (f"; it is {verdict.base_diff:.4f} from the base model's: it serves the base (adapter not loaded, or "
               "requests without their adapter)" if verdict.base_diff <= tolerance else
               ": it serves other weights than the trainer's (a stale or partial adapter, or weights that never "
               "arrived)")
        message = (f"replica {verdict.replica} serves version {verdict.version} with probe logprobs "
                   f"{verdict.diff:.4f} (mean |delta| over {tokens} tokens) from the trainer's, above "
                   f"loop.policy_guard.tolerance = {tolerance:g}{why}")
        if self.settings.action == "fail":
            raise PolicyGuardError(message)
        logger.warning("policy guard: %s", message)

    def metrics(self) -> dict[str, float]:
        """The latest check's figures for a step's metrics (nothing before the first check)."""
        if self.last is None:
            return {}
        return {"policy/guard_version": float(self.last.version), "policy/guard_abs_diff": self.last.diff,
                "policy/guard_alarm": float(self.last.diff > self.settings.tolerance)}


def mean_abs(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)
