"""The Tinker front's futures: each model's requests run in seq_id order whatever order they arrive in, a
failed one still lets the next run, a used seq_id is refused, and a poll is held, then answered "not yet"."""

from __future__ import annotations

import asyncio

import pytest

from lorarl.tinker.futures import Futures, UserError


def test_requests_run_in_seq_order_and_a_failure_lets_the_next_run() -> None:
    async def body() -> None:
        futures = Futures(hold_s=5)
        futures.start_model("m")
        ran: list[int] = []

        def work(seq: int, fail: bool = False):
            async def run():
                await asyncio.sleep(0.01 * (4 - seq))  # later seq_ids would finish first if run at once
                ran.append(seq)
                if fail:
                    raise UserError(f"bad {seq}")
                return {"seq": seq}
            return run

        ids = {seq: futures.submit_ordered("m", seq, work(seq, fail=seq == 2)) for seq in (3, 2, 4, 1)}
        outcomes = {seq: await futures.retrieve(rid) for seq, rid in ids.items()}
        assert ran == [1, 2, 3, 4]
        assert outcomes[2].error == "bad 2" and outcomes[2].category == "user"
        assert [outcomes[s].json for s in (1, 3, 4)] == [{"seq": 1}, {"seq": 3}, {"seq": 4}]
        with pytest.raises(UserError, match="seq_id 3 of model 'm' was already used"):
            futures.submit_ordered("m", 3, work(3))
        with pytest.raises(UserError, match="unknown model_id"):
            futures.submit_ordered("other", 1, work(1))
        await futures.close()

    asyncio.run(body())


def test_an_ended_models_requests_waiting_for_their_turn_fail_and_the_running_one_finishes() -> None:
    """A request sent ahead of its turn (seq 3 and 4 while 1 runs and 2 never comes) would otherwise wait for ever
    when its model ends, holding its tenant's queue: end_model fails each one waiting, names their owners (so
    their places are freed), lets the running one finish, and runs nothing after it."""
    async def body() -> None:
        futures = Futures(hold_s=5)
        futures.start_model("m")
        release = asyncio.Event()
        ran: list[int] = []

        def work(seq: int):
            async def run():
                ran.append(seq)
                await release.wait()
                return {"seq": seq}
            return run

        ids = {seq: futures.submit_ordered("m", seq, work(seq), owner="team-b") for seq in (1, 3, 4)}
        await asyncio.sleep(0.01)
        assert futures.end_model("m", "model 'm' ended") == ["team-b", "team-b"]
        for seq in (3, 4):
            outcome = await futures.retrieve(ids[seq], "team-b")
            assert outcome.error == "model 'm' ended" and outcome.category == "user"
        release.set()
        assert (await futures.retrieve(ids[1], "team-b")).json == {"seq": 1}
        futures.submit_ordered("m", 2, work(2), owner="team-b")
        assert (await futures.retrieve(futures.resubmitted("m", 2, "team-b"), "team-b")).json == {"seq": 2}
        assert ran == [1, 2] and futures.end_model("m", "again") == []
        await futures.close()

    asyncio.run(body())


def test_a_poll_is_held_then_answered_not_yet_and_a_server_fault_is_the_servers() -> None:
    async def body() -> None:
        futures = Futures(hold_s=0.05)
        gate = asyncio.Event()

        async def slow():
            await gate.wait()
            raise RuntimeError("engine fell over")

        rid = futures.submit(slow)
        assert await futures.retrieve(rid) is None  # held 0.05 s, then "try_again"
        gate.set()
        outcome = await futures.retrieve(rid)
        assert outcome.category == "server" and "engine fell over" in outcome.error
        with pytest.raises(KeyError):
            await futures.retrieve("req-unknown")
        await futures.close()

    asyncio.run(body())
