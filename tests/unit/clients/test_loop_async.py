"""The asynchronous loop's scheduling, against in-process stand-ins for the three services' stubs.

What is checked here is the order of events the loop creates (when a batch may start generating,
which version trains it, what happens when generation fails), so the stubs only answer and record;
the loop against the real services is tests/e2e/test_rl_loop.py.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import grpc
import pytest

from lorarl.client.job.config import load_job_config
from lorarl.client.job.datasets import Example
from lorarl.client.rl.loop import RLLoop
from lorarl.v1 import rollout_pb2, trainer_pb2, weightsync_pb2

ROOT = Path(__file__).resolve().parents[3]


class Recorder:
    """Stub of the rollout, trainer and weight-sync services: a shared clock of events."""

    def __init__(self, generate_s: float, train_s: float, activate_s: float = 0.0, fail_batch: int = -1,
                 fail_version: int = -1) -> None:
        self.generate_s, self.train_s, self.activate_s = generate_s, train_s, activate_s
        self.fail_batch, self.fail_version = fail_batch, fail_version
        self.events: list[tuple[str, int, int]] = []  # (what, batch or version, version serving then)
        self.trained = 0  # the trainer's version
        self.version = 0  # the version the rollout serves
        self.activations: list[asyncio.Task[None]] = []
        self.unavailable = 0  # AwaitActivation calls to refuse as a restarting service would

    # rollout
    async def Generate(self, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:  # noqa: N802
        if "-eval-" in request.request_id:  # a held-out episode
            return rollout_pb2.GenerateResponse(results=[
                rollout_pb2.PromptCompletions(completions=[rollout_pb2.Completion(text="0")])
                for _ in request.prompts])
        # one request per episode: <job>-b<batch>-p<prompt>-s<sample call>
        match = re.search(r"-b(\d+)-p(\d+)-s\d+$", request.request_id)
        batch, first = int(match.group(1)), match.group(2) == "0"  # events: the batch's first episode's
        if first:
            self.events.append(("generate-start", batch, self.version))
        served = self.version
        await asyncio.sleep(self.generate_s)
        if batch == self.fail_batch:
            raise RuntimeError(f"generation of batch {batch} failed")
        if first:
            self.events.append(("generate-end", batch, self.version))
        completion = rollout_pb2.Completion(token_ids=[5, 6], logprobs=[-1.0, -1.0], token_versions=[served] * 2,
                                            text="1")
        return rollout_pb2.GenerateResponse(results=[
            rollout_pb2.PromptCompletions(prompt_token_ids=[1, 2, 3],
                                          completions=[completion] * request.sampling.n)
            for _ in request.prompts])

    # trainer
    async def PushTrajectories(self, requests):  # noqa: N802
        async for _ in requests:
            yield trainer_pb2.PushTrajectoriesResponse()

    async def TrainStep(self, request: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:  # noqa: N802
        self.events.append(("train-start", self.trained, self.version))
        await asyncio.sleep(self.train_s)
        self.trained += 1
        return trainer_pb2.TrainStepResponse(version=self.trained)

    async def PublishWeights(  # noqa: N802
            self, request: trainer_pb2.PublishWeightsRequest) -> trainer_pb2.PublishWeightsResponse:
        version = self.trained

        async def activate() -> None:
            await asyncio.sleep(self.activate_s)
            if version != self.fail_version:
                self.version = version
                self.events.append(("active", version, version))

        self.activations.append(asyncio.create_task(activate()))
        if request.wait_for_activation:
            await self.activations[-1]
            return trainer_pb2.PublishWeightsResponse(version=version, activated=self.version == version)
        return trainer_pb2.PublishWeightsResponse(version=version)

    # weight sync
    async def AwaitActivation(  # noqa: N802
            self, request: weightsync_pb2.AwaitActivationRequest, timeout: float | None = None
    ) -> weightsync_pb2.AwaitActivationResponse:
        if self.unavailable:
            self.unavailable -= 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="weight sync restarting")
        await asyncio.gather(*self.activations)
        outcome = weightsync_pb2.ACTIVATION_OUTCOME_ACTIVE if self.version >= request.version \
            else weightsync_pb2.ACTIVATION_OUTCOME_FAILED
        return weightsync_pb2.AwaitActivationResponse(version=request.version, outcome=outcome,
                                                      error="" if outcome == 2 else "staging failed on rollout-0")


def run_loop(stub: Recorder, steps: int, max_staleness: int, overlap: bool = False, eval_every: int = 0) -> RLLoop:
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"),
                          [f"loop.steps={steps}", "loop.prompts_per_step=2", "rollout.group_size=2",
                           f"loop.eval_every={eval_every}", f"loop.max_staleness={max_staleness}",
                           "loop.policy_guard.every=0"])  # the guard has its own tests (test_policy_guard.py)
    examples = [Example(f"q{i}", "1") for i in range(8)]
    loop = RLLoop(cfg, trainer=stub, rollout=stub, reward=lambda text, answer: float(text == answer),
                  train=examples, test=examples[:2], on_metrics=lambda row: None,
                  weightsync=stub if overlap else None)
    asyncio.run(asyncio.wait_for(loop.run(), timeout=20))
    return loop


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_batch_starts_as_soon_as_admitted_even_while_the_previous_one_decodes(max_staleness: int) -> None:
    stub = Recorder(generate_s=0.05, train_s=0.01)
    loop = run_loop(stub, steps=6, max_staleness=max_staleness)
    assert loop.state.step == 6 and stub.version == 6
    starts = {b: v for what, b, v in stub.events if what == "generate-start"}
    assert sorted(starts) == list(range(6))
    # admission: batch b is trained at version b, so it may start once version b - bound serves, not before
    assert all(version >= b - max_staleness for b, version in starts.items()), starts
    # and it does not wait for the previous batch: generation takes 5x a train step, so admission is
    # granted while batch b-1 still decodes and the two overlap
    order = [(what, b) for what, b, _ in stub.events if what.startswith("generate")]
    overlapped = [b for b in range(1, 6) if order.index(("generate-start", b)) < order.index(("generate-end", b - 1))]
    assert overlapped, order
    assert 1 not in overlapped  # but the first batch, which everything waits for, decodes alone
    lags = [row["policy/version_lag"] for row in loop.state.history]
    assert max(lags) <= max_staleness and max(lags) >= 1


def test_a_failed_generation_ends_the_run_with_its_error() -> None:
    stub = Recorder(generate_s=0.01, train_s=0.01, fail_batch=2)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="batch 2 failed"):
        run_loop(stub, steps=6, max_staleness=1)
    assert time.perf_counter() - started < 10  # at once, not after the loop's 20 s guard gave up waiting


def test_with_weight_sync_the_next_step_trains_while_the_version_activates() -> None:
    stub = Recorder(generate_s=0.01, train_s=0.03, activate_s=0.05)
    loop = run_loop(stub, steps=6, max_staleness=2, overlap=True, eval_every=3)
    assert loop.state.step == 6 and loop.state.version == 6  # the last version serves before the loop ends
    trains = [(v, serving) for what, v, serving in stub.events if what == "train-start"]
    # step s+1 trains while version s (just published) is still activating, except after step 3: an
    # evaluation follows it, and it must see version 3 serving
    assert [v for v, serving in trains if serving < v] == [1, 2, 4, 5], trains
    starts = {b: v for what, b, v in stub.events if what == "generate-start"}
    assert all(version >= b - 2 for b, version in starts.items()), starts  # admission waits for activation
    lags = [row["policy/version_lag"] for row in loop.state.history]
    assert max(lags) <= 2, lags


def test_a_failed_activation_stops_the_run() -> None:
    stub = Recorder(generate_s=0.01, train_s=0.01, activate_s=0.01, fail_version=3)
    with pytest.raises(RuntimeError, match="version 3 was not activated: staging failed"):
        run_loop(stub, steps=6, max_staleness=1, overlap=True)


def test_activation_waits_ride_out_a_weight_sync_restart() -> None:
    stub = Recorder(generate_s=0.01, train_s=0.01, activate_s=0.01)
    stub.unavailable = 2
    loop = run_loop(stub, steps=3, max_staleness=1, overlap=True)
    assert loop.state.version == 3 and stub.unavailable == 0
