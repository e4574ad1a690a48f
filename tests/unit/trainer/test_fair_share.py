"""Jobs on one base take turns by weighted fair share: compute time in proportion to their shares while they
wait, no credit banked while idle, and a cancelled call never keeps the base."""

from __future__ import annotations

import asyncio

import pytest

from lorarl.trainer.service.fair_share import FairShare


class Clock:
    """Seconds that pass only when a turn's body says so: the turns' order, not the machine's load, decides."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def busy(share: FairShare, clock: Clock, job: str, weight: float, seconds: float, calls: int,
               log: list[tuple[str, float]], callers: int = 1, account: str | None = None) -> None:
    """``calls`` turns of ``seconds`` each, from ``callers`` concurrent callers (a job with calls in flight)."""
    async def caller(count: int) -> None:
        for _ in range(count):
            async with share.turn(job, weight, account):
                clock.now += seconds
                log.append((job, clock.now))
                await asyncio.sleep(0)  # the others queue meanwhile

    await asyncio.gather(*(caller(calls // callers) for _ in range(callers)))


def test_compute_time_follows_the_shares_while_jobs_wait() -> None:
    async def main() -> list[tuple[str, float]]:
        clock, log = Clock(), []
        share = FairShare(clock)
        await asyncio.gather(busy(share, clock, "a", 3.0, 1.0, 60, log, callers=3),
                             busy(share, clock, "b", 1.0, 1.0, 60, log, callers=3))
        return log

    first = [job for job, _ in asyncio.run(main())[:40]]  # while both have calls waiting: 3 of a for 1 of b
    assert abs(first.count("a") - 30) <= 1 and abs(first.count("b") - 10) <= 1, first


def test_a_tenants_jobs_share_one_account_so_many_jobs_do_not_buy_more_of_the_base() -> None:
    """Four jobs of one tenant (a team flooding the Tinker front with models) against one job of another: while
    all wait, each tenant gets half the base, not four fifths to one (trainer.tenants: the key that created a job)."""
    async def main(accounts: bool) -> list[tuple[str, float]]:
        clock, log = Clock(), []
        share = FairShare(clock)
        flood = [busy(share, clock, f"flood-{i}", 1.0, 1.0, 40, log, account="tenant:flood" if accounts else None)
                 for i in range(4)]
        await asyncio.gather(*flood, busy(share, clock, "quiet", 1.0, 1.0, 40, log,
                                          account="tenant:quiet" if accounts else None))
        return log

    by_tenant = [job for job, _ in asyncio.run(main(accounts=True))[:40]]
    assert abs(by_tenant.count("quiet") - 20) <= 1, by_tenant
    by_job = [job for job, _ in asyncio.run(main(accounts=False))[:40]]  # each job its own account: 1 in 5
    assert abs(by_job.count("quiet") - 8) <= 1, by_job


def test_a_job_that_sends_many_small_calls_does_not_crowd_out_one_with_large_calls() -> None:
    async def main() -> list[tuple[str, float]]:
        clock, log = Clock(), []
        share = FairShare(clock)
        await asyncio.gather(busy(share, clock, "chatty", 1.0, 0.1, 400, log, callers=4),
                             busy(share, clock, "bulk", 1.0, 2.0, 10, log, callers=2))
        return log

    log = asyncio.run(main())
    bulk_done = max(t for job, t in log if job == "bulk")
    chatty_seconds = 0.1 * sum(1 for job, t in log if job == "chatty" and t <= bulk_done)
    # equal shares: by the time bulk's 20 s were done, chatty had had about 20 s too, not 10 calls to bulk's 10
    assert chatty_seconds == pytest.approx(20.0, abs=2.1), chatty_seconds


def test_an_idle_job_banks_no_credit() -> None:
    async def main() -> list[tuple[str, float]]:
        clock, log = Clock(), []
        share = FairShare(clock)
        await busy(share, clock, "early", 1.0, 1.0, 20, log)  # alone for 20 s
        log.clear()
        await asyncio.gather(busy(share, clock, "early", 1.0, 1.0, 20, log, callers=2),
                             busy(share, clock, "late", 1.0, 1.0, 20, log, callers=2))
        return log

    first = [job for job, _ in asyncio.run(main())[:10]]
    # the newcomer enters at the time now, not at zero: it does not get 20 turns in a row
    assert 4 <= first.count("late") <= 6, first


def test_a_cancelled_wait_leaves_the_base_to_the_others_and_a_share_must_be_positive() -> None:
    async def main() -> list[str]:
        clock, log = Clock(), []
        share = FairShare(clock)
        release = asyncio.Event()

        async def hold() -> None:
            async with share.turn("holder"):
                await release.wait()

        holder = asyncio.ensure_future(hold())
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(busy(share, clock, "gone", 1.0, 1.0, 1, log))
        patient = asyncio.ensure_future(busy(share, clock, "patient", 1.0, 1.0, 1, log))
        await asyncio.sleep(0)
        waiting.cancel()
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, patient), 5)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(ValueError):
            async with share.turn("x", 0.0):
                pass
        return [job for job, _ in log]

    assert asyncio.run(main()) == ["patient"]
