"""The RL loop, in plain sight: run episodes, train on them, publish, repeat.

    sync:   generate(batch s, policy s) -> train step s -> publish s+1 -> generate(batch s+1) ...
    async:  a producer keeps generating while the trainer trains; batch b may start only when the
            served policy is at least b - max_staleness (AReaL-style admission), and the trainer's
            decoupled loss corrects for the lag. Every token's policy version travels with it.

An episode is the job's workflow (lorarl.client.workflow: by default one prompt, a group of sampled
completions and their rewards) run on one example, in a context pinned to the policy version serving
when its batch was admitted; a batch's episodes run concurrently. The loop talks to the three services
only through their gRPC stubs, so the same code drives the
local stack of `lorarl run` and services running elsewhere (`lorarl train`). When a call fails in a
way worth waiting out (lorarl.client.rl.recovery), the loop drops its in-flight work, lets ``recover``
bring the job back to its last resume point, and carries on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lorarl.client.job.config import JobFileConfig, training_spec
from lorarl.client.job.datasets import Example, TrainStream
from lorarl.client.job.inputs import Teacher, domain_teacher
from lorarl.client.job.rewards import Reward, RewardFn
from lorarl.client.rl import metric_names as names
from lorarl.client.rl.guard import PolicyGuard, Probe
from lorarl.client.rl.mismatch import MismatchAlarm
from lorarl.client.rl.recovery import ActivationFailedError, RecoveryBudget, recoverable
from lorarl.client.workflow import Episode, Workflow, load_workflow
from lorarl.client.workflow.agent_http import AgentHttp
from lorarl.client.workflow.coalesce import CoalescingRollout
from lorarl.client.workflow.context import RolloutContext, SamplingDefaults
from lorarl.contract import staleness, versions
from lorarl.contract.chat import ChatRenderer
from lorarl.contract.enums import SYNC_MODES
from lorarl.v1 import common_pb2, trainer_pb2, weightsync_pb2
from lorarl.weightsync.client.activation import await_outcome

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Held-out episodes running at once.
EVAL_CHUNK = 64


def job_config_proto(cfg: JobFileConfig, model_path: str) -> trainer_pb2.JobConfig:
    """The trainer's JobConfig for this run (lorarl.client.job.config.training_spec)."""
    return training_spec(cfg, model_path).to_proto()


@dataclass
class Batch:
    """One step's worth of scored trajectories."""

    index: int
    trajectories: list[common_pb2.Trajectory]
    rewards: list[float]
    accuracy: float
    generate_s: float
    tokens: int
    min_version: int
    reward_errors: int = 0  # samples scored 0 because the reward function failed on them
    context_tokens: int = 0  # tokens tools and environments added to episodes (conditioned on, not trained)
    unpinned: int = 0  # samples served by a later version than their episode's (merged weights moved on)
    lengths: list[int] = field(default_factory=list)  # each sample's policy tokens (its response length)
    truncated: int = 0  # samples that ended at max_tokens rather than on a stop
    groups: list[list[float]] = field(default_factory=list)  # each prompt's samples' rewards
    samples: list[dict[str, Any]] = field(default_factory=list)  # a few (prompt, completion, reward) to read
    distill: dict[str, float] = field(default_factory=dict)  # per-teacher metrics (distill/*): distillation only


#: Samples of each step written out to read (samples.jsonl, TensorBoard text): the first of this many prompts.
SAMPLES_PER_STEP = 2


def rollout_stats(batch: Batch) -> dict[str, float]:
    """What RL users read of a step's samples: response lengths, the share cut at max_tokens, the reward's spread,
    and the share of groups whose samples all scored the same (their group-relative advantages are all 0: they
    teach nothing)."""
    rewards = batch.rewards
    mean = sum(rewards) / max(len(rewards), 1)
    spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1))
    groups = [g for g in batch.groups if len(g) > 1]
    stats = {names.REWARD_STD: spread,
             names.TRUNCATED_FRACTION: batch.truncated / max(len(batch.lengths), 1),
             names.ZERO_ADVANTAGE_GROUPS: sum(max(g) == min(g) for g in groups) / max(len(groups), 1)}
    if batch.lengths:
        stats.update({names.RESPONSE_LENGTH_MEAN: sum(batch.lengths) / len(batch.lengths),
                      names.RESPONSE_LENGTH_MAX: float(max(batch.lengths))})
    return {**stats, **batch.distill}


def distill_stats(episodes: list[list[Episode]], teacher_seconds: float) -> dict[str, float]:
    """Per teacher (an episode's ``teacher``: its route's, or "mixture"): the mean reverse KL of the policy's
    sampled tokens to it (log pi_behaviour - log pi_teacher), the mean reward, and its share of the prompts; and
    the replicas' seconds scoring the step. Empty when no episode was scored."""
    kl: dict[str, list[float]] = {}
    rewards: dict[str, list[float]] = {}
    prompts: dict[str, int] = {}
    for group in episodes:
        scored = [e for e in group if e.teacher_logprobs is not None]
        if scored:
            prompts[scored[0].teacher] = prompts.get(scored[0].teacher, 0) + 1
        for e in scored:
            assert e.teacher_logprobs is not None
            terms = [b - t for b, t, m in zip(e.logprobs, e.teacher_logprobs, e.loss_mask, strict=True) if m]
            kl.setdefault(e.teacher, []).extend(terms)
            rewards.setdefault(e.teacher, []).append(float(e.reward))
    if not prompts:
        return {}
    total = sum(prompts.values())
    out = {names.TEACHER_SECONDS: teacher_seconds}
    for teacher, count in prompts.items():
        out[names.teacher_metric(teacher, "reverse_kl")] = sum(kl[teacher]) / max(len(kl[teacher]), 1)
        out[names.teacher_metric(teacher, "reward_mean")] = sum(rewards[teacher]) / len(rewards[teacher])
        out[names.teacher_metric(teacher, "prompt_share")] = count / total
    return out


@dataclass
class LoopState:
    step: int = 0
    version: int = 0  # last version published and serving
    cursor: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    #: The trainer's version minus its step: 0 until a resume continues above weight sync's numbers.
    version_base: int = 0

    def trains_at(self, batch_index: int) -> int:
        """The trainer version batch ``batch_index`` trains (its step, shifted past reused numbers)."""
        return versions.trained_by(batch_index, self.version_base)


MetricSink = Callable[[dict[str, float]], None]
#: Saves the job under a checkpoint name ("resume", "step-000010") and records it as the resume point.
Checkpoint = Callable[[LoopState, str], Awaitable[None]]
#: Brings the job back to its last resume point after a fault; the state to carry on from.
Recover = Callable[[], Awaitable[LoopState]]


#: Bytes of trajectories per PushTrajectories message: a step's trajectories, routed experts included (384 B per
#: token at Qwen3-30B-A3B), stay well under gRPC's message limit (lorarl.common.channel: 256 MiB) in any batch.
PUSH_PART_BYTES = 32 << 20


def push_parts(trajectories: list, limit: int = PUSH_PART_BYTES) -> list[list]:
    """Consecutive runs of ``trajectories`` of at most ``limit`` serialized bytes each (one, if larger)."""
    parts: list[list] = []
    size = 0
    for t in trajectories:
        n = t.ByteSize()
        if not parts or (size + n > limit and parts[-1]):
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += n
    return parts


class RLLoop:
    """Drives one job through the trainer, rollout and weight-sync services."""

    def __init__(self, cfg: JobFileConfig, trainer, rollout, reward: RewardFn | Reward, train: list[Example],
                 test: list[Example], on_metrics: MetricSink, state: LoopState | None = None,
                 on_checkpoint: Checkpoint | None = None, weightsync=None, recover: Recover | None = None,
                 on_rewind: Callable[[int], None] | None = None, workflow: Workflow | None = None,
                 openai_urls: Callable[[], list[str]] | None = None, token: str | None = None,
                 on_samples: Callable[[int, list[dict[str, Any]]], None] | None = None,
                 teachers: Sequence[Teacher] = ()) -> None:
        """``on_samples``: gets a few of each step's samples to read (the run log's samples.jsonl); ``teachers``:
        on-policy distillation's (lorarl.client.job.inputs.job_teachers), served as their own jobs' latest version."""
        self.cfg, self.trainer, self.rollout = cfg, trainer, rollout
        self.teachers = list(teachers)
        self._teacher_policies = [t.policy(cfg.job_id) for t in self.teachers]
        self.on_samples = on_samples
        self.sampler = CoalescingRollout(rollout)  # what episodes sample through
        self.openai_urls, self.token = openai_urls or (lambda: []), token
        self.http = AgentHttp()  # every episode's agent calls share one connection pool
        d = cfg.data
        self._owns_reward = not isinstance(reward, Reward)
        self.reward = reward if isinstance(reward, Reward) else Reward(reward, d.reward_errors, d.reward,
                                                                        d.reward_workers)
        job_dir = getattr(cfg, "job_dir", "")
        self.workflow = workflow or load_workflow(cfg.workflow.name, cfg.workflow.settings, job_dir)
        self.renderer = ChatRenderer(cfg.model.path, chat_template=d.chat_template, system_prompt=d.system_prompt,
                                     enable_thinking=d.enable_thinking)
        _ = self.renderer.tokenizer  # loaded now, not inside the first step (transformers' takes seconds)
        # With the weight-sync stub, the async loop trains the next batch while a version activates.
        self.weightsync = weightsync
        self._activating: asyncio.Task[None] | None = None
        self.state = state or LoopState()
        self.examples = train
        self.stream = TrainStream(train, cfg.data.seed, self.state.cursor)
        self.test = test[: cfg.data.eval_size] if cfg.data.eval_size else test
        self.on_metrics = on_metrics
        self.on_checkpoint = on_checkpoint
        self.recover, self.on_rewind = recover, on_rewind
        self._served_by: list[str] = []
        self.budget = RecoveryBudget(cfg.recovery.max_recoveries, cfg.recovery.wait_s,
                                     healthy_steps=cfg.recovery.healthy_steps)
        self.mismatch = MismatchAlarm(cfg.loop.mismatch_alarm)
        self.guard = PolicyGuard(cfg.loop.policy_guard, self._probe())
        self.started = time.perf_counter()
        self._published = asyncio.Event()

    def _probe(self) -> Probe:
        """The policy guard's probe: the first held-out (else training) example, rendered as the job renders its
        prompts, its answer as the completion."""
        example = (self.test or self.examples)[0]
        completion = [int(t) for t in self.renderer.tokenizer.encode(str(example.answer), add_special_tokens=False)]
        return Probe(self.renderer.prompt_ids(example.prompt), completion or [int(self.renderer.tokenizer.eos_token_id
                                                                                 or 0)])

    def _replicas(self) -> list[tuple[str, Any]]:
        """Every rollout replica the loop samples from, by name (the guard probes each)."""
        each = getattr(self.rollout, "each_replica", None)
        return each() if callable(each) else [("rollout", self.rollout)]

    # ------------------------------------------------------------------ rollout

    def routed(self, example: Example) -> tuple[list[float], str]:
        """The teachers' weights for ``example``'s samples and who scores them (a teacher's name, or "mixture");
        ([], "") without teachers."""
        d = self.cfg.distill
        if not self.teachers:
            return [], ""
        if d.route == "mixture":
            return [t.weight for t in self.teachers], "mixture"
        owner = domain_teacher(self.cfg, example)  # self.teachers are distill.teachers, read in their order
        if owner is None:  # the dry run and lorarl run refuse such rows (lorarl.client.job.inputs.teacher_routes)
            raise ValueError(f"an example's {d.route_key}={example.columns.get(d.route_key)!r} names no teacher's "
                             "domain")
        return [float(i == owner) for i in range(len(self.teachers))], self.teachers[owner].name

    def _context(self, version: int, request_id: str, seed: int, evaluating: bool = False, batch: str = "",
                 episode: int = 0, teacher_weights: list[float] | None = None) -> RolloutContext:
        """An episode's context, pinned to ``version`` (0: the base model); a training episode's ``teacher_weights``
        (``routed``) send its samples to their teachers (distillation)."""
        r = self.cfg.rollout
        sampling = SamplingDefaults(temperature=0.0 if evaluating else r.temperature,
                                    top_p=1.0 if evaluating else r.top_p,
                                    max_tokens=r.eval_max_tokens if evaluating else r.max_tokens)
        return RolloutContext(self.sampler, self.cfg.job_id, version, self.renderer, self.reward, sampling,
                              1 if evaluating else r.group_size, seed=seed, request_id=request_id,
                              evaluating=evaluating, batch=batch, openai_url=self._openai_url(episode),
                              token=self.token, http=self.http,
                              **({"teachers": self._teacher_policies, "teacher_weights": teacher_weights}
                                 if teacher_weights else {}))

    def _openai_url(self, episode: int) -> str:
        """The endpoint an episode's agent talks to: one replica for its whole life (sessions live there)."""
        urls = self.openai_urls()
        return urls[episode % len(urls)] if urls else ""

    async def generate(self, index: int, examples: list[Example]) -> Batch:
        """Batch ``index``: one episode per example, all at once, pinned to the version serving now."""
        version = self.state.version
        seed = self.cfg.data.seed * 100_003 + index * 1_009
        routes = [self.routed(example) for example in examples]  # (teacher weights, who scores) per example
        contexts = [self._context(version, f"{self.cfg.job_id}-b{index}-p{p}", seed + p, batch=f"b{index}",
                                  episode=index * len(examples) + p, teacher_weights=routes[p][0])
                    for p in range(len(examples))]
        started = time.perf_counter()
        results: list[list[Episode]] = await asyncio.gather(
            *(self.workflow.run(ctx, example) for ctx, example in zip(contexts, examples, strict=True)))
        elapsed = time.perf_counter() - started
        trajectories, rewards, lengths, groups, samples = [], [], [], [], []
        tokens = context_tokens = truncated = 0
        min_version = 1 << 62
        for (_, teacher), episodes in zip(routes, results, strict=True):
            for episode in episodes:
                episode.teacher = teacher
        for p, episodes in enumerate(results):
            groups.append([float(e.reward) for e in episodes])
            for c, episode in enumerate(episodes):
                rewards.append(float(episode.reward))
                tokens += episode.policy_tokens
                lengths.append(episode.policy_tokens)
                truncated += episode.finish_reason == common_pb2.FINISH_REASON_LENGTH
                context_tokens += len(episode.completion_ids) - episode.policy_tokens
                if c == 0 and p < SAMPLES_PER_STEP:
                    samples.append(self._sample(examples[p], episode))
                trained = [v for v, m in zip(episode.versions, episode.loss_mask, strict=True) if m]
                if trained:
                    min_version = min(min_version, min(trained))
                if not episode.policy_tokens:
                    continue  # nothing the policy sampled: nothing to learn from
                trajectories.append(episode.to_proto(self.cfg.job_id, f"b{index}-p{p}-c{c}", f"b{index}-p{p}"))
        accuracy = names.successes(rewards, self.cfg.loop.success_reward)
        return Batch(index, trajectories, rewards, accuracy, elapsed, tokens,
                     min_version if min_version < 1 << 62 else 0, sum(c.reward_errors for c in contexts),
                     context_tokens, sum(c.unpinned for c in contexts), lengths, truncated, groups, samples,
                     distill_stats(results, sum(c.teacher_seconds for c in contexts)))

    def _sample(self, example: Example, episode: Episode) -> dict[str, Any]:
        """One sample to read: its prompt as written, its completion as decoded, its reward and answer."""
        return {"prompt": example.prompt, "completion": self.renderer.decode(episode.completion_ids),
                "reward": float(episode.reward), "answer": example.answer_text(),
                "truncated": episode.finish_reason == common_pb2.FINISH_REASON_LENGTH}

    async def evaluate(self) -> dict[str, float]:
        """Greedy accuracy and mean reward of the held-out episodes, with the current policy."""
        version = self.state.version
        limit = asyncio.Semaphore(EVAL_CHUNK)
        contexts = [self._context(version, f"{self.cfg.job_id}-eval-v{version}-p{p}", p, evaluating=True,
                                  batch=f"eval-{p // EVAL_CHUNK}", episode=p) for p in range(len(self.test))]

        async def run(ctx: RolloutContext, example: Example) -> list[Episode]:
            async with limit:
                return await self.workflow.run(ctx, example)

        results = await asyncio.gather(*(run(c, e) for c, e in zip(contexts, self.test, strict=True)))
        scores = [float(episode.reward) for episodes in results for episode in episodes]
        out = {names.EVAL_ACCURACY: names.successes(scores, self.cfg.loop.success_reward),
               names.EVAL_MEAN_REWARD: sum(scores) / max(len(scores), 1),
               "eval/reward_errors": float(sum(c.reward_errors for c in contexts))}
        if column := self.cfg.eval_column:  # e.g. each task of a mixed dataset on its own
            by_value: dict[str, list[float]] = {}
            for example, episodes in zip(self.test, results, strict=True):
                value = example.columns.get(column)
                if value is not None:
                    by_value.setdefault(str(value), []).extend(float(e.reward) for e in episodes)
            out.update({names.eval_accuracy_of(value): names.successes(rewards, self.cfg.loop.success_reward)
                        for value, rewards in by_value.items()})
        return out

    # ------------------------------------------------------------------ trainer

    async def train(self, batch: Batch) -> dict[str, float]:
        job = self.cfg.job_id

        async def requests():
            for part in push_parts(batch.trajectories):
                yield trainer_pb2.PushTrajectoriesRequest(job_id=job, trajectories=part)

        refused = 0
        async for response in self.trainer.PushTrajectories(requests()):
            rejected = [s for s in response.statuses if s.code != 0]
            if rejected:
                refused += len(rejected)
                logger.warning("trainer refused %d trajectories, e.g. %s: %s", len(rejected), rejected[0].field,
                               rejected[0].message)
        if refused and refused == len(batch.trajectories):
            raise RuntimeError(f"the trainer refused all {refused} trajectories of step {batch.index} "
                               f"({rejected[0].field}: {rejected[0].message}); nothing to train on")
        result = await self.trainer.TrainStep(trainer_pb2.TrainStepRequest(job_id=job))
        metrics = names.train_metrics(result.metrics.values)
        metrics[names.VERSION] = result.version
        # moves when the trainer renumbered: result.version is what batch.index's step made
        self.state.version_base = versions.base_of(result.version, batch.index + 1)
        return metrics

    async def publish(self, overlap: bool = False) -> dict[str, float]:
        """Publishes the trainer's version. With ``overlap`` (and a weight-sync stub) it returns once the
        trainer has sent it, and the activation is awaited in the background (``settled``): the trainer's
        next step then runs while the rollouts stage the version. The version counts as serving, for
        admission and the policy selector, only once it is active."""
        await self.settled()  # versions go live in order
        overlap = overlap and self.weightsync is not None
        response = await self.trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(
            job_id=self.cfg.job_id, mode=SYNC_MODES[self.cfg.sync.mode], wait_for_activation=not overlap,
            timeout_seconds=600))
        if not response.error:  # the trainer holds this version until its next step: score the guard's probe now
            await self.guard.expect(self.trainer, self.cfg.job_id, response.version)
        if overlap and not response.error:
            self._activating = asyncio.create_task(self._await_activation(response.version))
        elif not response.activated:
            raise ActivationFailedError(f"version {response.version} was not activated: {response.error} "
                                   f"(failed replicas: {list(response.failed_replicas)})")
        else:
            await self.guard.check(self._replicas(), self.cfg.job_id, response.version)
            self._serving(response.version)
        return {"sync/seconds": response.seconds, "sync/bytes": float(response.payload_bytes),
                "sync/version": float(response.version)}

    async def settled(self) -> None:
        """Returns once the last published version serves; raises if its activation failed."""
        if self._activating is not None:
            try:
                await self._activating
            finally:
                self._activating = None

    async def _await_activation(self, version: int, timeout_s: float = 600.0) -> None:
        response = await await_outcome(self.weightsync, self.cfg.job_id, version, timeout_s)
        if response.outcome != weightsync_pb2.ACTIVATION_OUTCOME_ACTIVE:
            raise ActivationFailedError(f"version {version} was not activated: "
                               f"{response.error or weightsync_pb2.ActivationOutcome.Name(response.outcome)} "
                               f"(failed replicas: {list(response.failed_replicas)})")
        await self.guard.check(self._replicas(), self.cfg.job_id, version)
        self._serving(version)

    def _serving(self, version: int) -> None:
        self.state.version = version
        self._published.set()

    # ------------------------------------------------------------------ the loop

    def _record(self, batch: Batch, train: dict[str, float], sync: dict[str, float], version_before: int) -> None:
        step = self.state.step
        metrics = {"step": float(step), "time_s": time.perf_counter() - self.started,
                   names.REWARD_MEAN: sum(batch.rewards) / max(len(batch.rewards), 1),
                   names.ACCURACY: batch.accuracy, "rollout/seconds": batch.generate_s,
                   "rollout/tokens": float(batch.tokens),
                   names.TOKENS_PER_S: batch.tokens / max(batch.generate_s, 1e-9),
                   "rollout/reward_errors": float(batch.reward_errors),
                   "rollout/context_tokens": float(batch.context_tokens),
                   "rollout/unpinned_samples": float(batch.unpinned),
                   names.VERSION_LAG: float(version_before - batch.min_version), **rollout_stats(batch),
                   **train, **sync, **self.guard.metrics()}
        if hasattr(self.rollout, "take_usage"):  # a pool: which replicas served the latest generation
            usage, redone = self.rollout.take_usage()
            if usage and sorted(usage) != self._served_by:  # none since the last step (async): as before
                self._served_by = sorted(usage)
                logger.info("step %d: prompts served by %s", step, ", ".join(self._served_by))
            metrics.update({"rollout/replicas": float(len(self._served_by)), "rollout/redone_prompts": float(redone),
                            "rollout/busy_waits": float(self.rollout.take_busy_waits())})
        self.state.history.append(metrics)
        if self.budget.progress(step):
            logger.info("step %d: %d steps without a fault since the last recovery; the fault count starts again "
                        "(recovery.healthy_steps)", step, self.budget.healthy_steps)
        try:
            self.mismatch.observe(metrics)
        finally:  # a step that ends the run is still written down
            self.on_metrics(metrics)
            if self.on_samples is not None and batch.samples:
                self.on_samples(step, batch.samples)

    async def _maybe_eval_and_checkpoint(self) -> None:
        """Evaluation and checkpoint, when due, see the step's version serving (it may be activating)."""
        loop = self.cfg.loop
        step = self.state.step
        if loop.eval_every and step % loop.eval_every == 0 and step < loop.steps:
            await self.settled()
            self.on_metrics({"step": float(step), "time_s": time.perf_counter() - self.started,
                             **await self.evaluate()})
        if self.on_checkpoint and loop.checkpoint_every and step % loop.checkpoint_every == 0:
            await self.settled()
            await self.on_checkpoint(self.state, f"step-{step:06d}")
        elif self.on_checkpoint and self.recover and step % self.cfg.recovery.resume_every == 0:
            # What a fault rewinds to. The version may still be activating: a restore publishes anew.
            await self.on_checkpoint(self.state, "resume")

    def _out_of_time(self) -> bool:
        limit = self.cfg.loop.time_limit_s
        return bool(limit) and time.perf_counter() - self.started > limit

    async def run(self) -> LoopState:
        try:
            return await self._run()
        finally:
            await self.http.aclose()
            if self._owns_reward:
                self.reward.close()

    async def _run(self) -> LoopState:
        if self.state.step == 0:  # a resumed run logged its evaluation at this step already
            first = await self._recovering(self.evaluate)
            self.on_metrics({"step": float(self.state.step), "time_s": 0.0, **first})
        await self._recovering(self._run_sync if self.cfg.loop.mode == "sync" else self._run_async)
        final = await self._recovering(self.evaluate)
        self.on_metrics({"step": float(self.state.step), "time_s": time.perf_counter() - self.started, **final})
        if self.on_checkpoint:
            await self._recovering(lambda: self.on_checkpoint(self.state, f"step-{self.state.step:06d}"))
        return self.state

    # ------------------------------------------------------------------ faults

    async def _recovering(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()``; after a failure worth waiting out, the job is restored and ``work`` runs again."""
        while True:
            try:
                return await work()
            except Exception as error:
                if self.recover is None or not self.cfg.recovery.enabled or not recoverable(error):
                    raise
                await self._restore(error)

    async def _restore(self, error: BaseException) -> None:
        """Waits out the fault and rewinds the loop to the job's resume point; raises once the budget is spent."""
        while True:
            delay = self.budget.spend(error)
            logger.warning("step %d: %s; recovering (fault %d of at most %d) in %.0f s", self.state.step, error,
                           self.budget.used, self.budget.max_recoveries, delay)
            await asyncio.sleep(delay)
            try:
                state = await self.recover()
                break
            except Exception as again:
                if not recoverable(again):
                    raise
                error = again
        logger.warning("recovered: carrying on from step %d (version %d)", state.step, state.version)
        self.budget.recovered(state.step)
        self.state = state
        self.stream = TrainStream(self.examples, self.cfg.data.seed, state.cursor)
        self._activating = None
        self._published = asyncio.Event()
        if self.on_rewind is not None:
            self.on_rewind(state.step)

    async def _run_sync(self) -> None:
        while self.state.step < self.cfg.loop.steps and not self._out_of_time():
            examples = self.stream.take(self.cfg.loop.prompts_per_step)
            batch = await self.generate(self.state.step, examples)
            self.state.cursor = self.stream.cursor  # == (step + 1) * prompts_per_step
            version_before = self.state.version
            train = await self.train(batch)
            sync = await self.publish()
            self.state.step += 1
            self._record(batch, train, sync, version_before)
            await self._maybe_eval_and_checkpoint()

    async def _run_async(self) -> None:
        bound = self.cfg.loop.max_staleness
        # Batches in index order, as tasks: a batch starts generating as soon as admission allows, even
        # while the previous one is still decoding, so the engine fills the slots its finished
        # sequences free with the next batch's prompts instead of running its tail half empty.
        queue: asyncio.Queue[asyncio.Task[Batch] | None] = asyncio.Queue()
        stop = asyncio.Event()
        generating: set[asyncio.Task[Batch]] = set()  # started and not yet taken by the trainer

        async def producer() -> None:
            index = first = self.state.step
            while index < self.cfg.loop.steps and not stop.is_set():
                # Admission: batch `index` is trained at trainer version `trains_at(index)`; its tokens
                # must come from a policy at most `bound` versions older.
                while not staleness.admits(self.state.version, self.state.trains_at(index), bound) \
                        and not stop.is_set():
                    self._published.clear()
                    await self._published.wait()
                if stop.is_set():
                    break
                examples = self.stream.take(self.cfg.loop.prompts_per_step)
                batch = asyncio.create_task(self.generate(index, examples))
                generating.add(batch)
                await queue.put(batch)
                if index == first:  # nothing trains before the first batch: it decodes alone, at full speed
                    await asyncio.wait([batch])
                index += 1
            await queue.put(None)

        task = asyncio.create_task(producer())
        try:
            while self.state.step < self.cfg.loop.steps:
                if self._out_of_time():
                    break
                pending = await queue.get()
                if pending is None:
                    break
                batch = await pending
                generating.discard(pending)
                train = await self.train(batch)
                sync = await self.publish(overlap=True)
                self.state.step += 1
                self.state.cursor = self.state.step * self.cfg.loop.prompts_per_step
                # the trainer's version before this step (the served one may still be activating)
                self._record(batch, train, sync, versions.previous(int(train[names.VERSION])))
                await self._maybe_eval_and_checkpoint()
            await self.settled()
        finally:
            stop.set()
            self._published.set()
            tasks = [task, *generating, *([self._activating] if self._activating else [])]
            self._activating = None
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
