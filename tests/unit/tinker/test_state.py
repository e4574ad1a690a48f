"""The Tinker front's state across a restart (lorarl/tinker/state.py): the state file written whole and atomically
and read back as it was (paths, sessions, models, sampling sessions, runs), a file the front cannot read refused
by name rather than replaced, and the request journal read back after a kill — finished outcomes retrievable
again, a request the kill caught running failed by name, each model's seq_ids going on, and a request the SDK
sends again with its seq_id answered with the first one's future."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from lorarl.tinker.futures import Futures, Outcome, UserError
from lorarl.tinker.runs import Run
from lorarl.tinker.service import Model, Sampler, Saved
from lorarl.tinker.state import RESTARTED, FrontState, Journal, Kinds, Snapshot

KINDS = Kinds(Saved, Sampler, Model, Run)


def test_the_state_comes_back_as_it_was_written(tmp_path: Path) -> None:
    state = FrontState(tmp_path / "state" / "front.json")
    assert state.load(KINDS) == Snapshot()  # no file yet: nothing kept
    sampler_path = "tinker://s:train:0/sampler_weights/v3"
    snapshot = Snapshot(
        saved={"tinker://s:train:0/weights/a": Saved("ckpt/a", "export/a", "base", 8, {"rank": 8})},
        paths={sampler_path: Sampler("base", "tinker-s-0", 3, sampler_path, "export/sampler-v3", {"rank": 8})},
        deleted={"tinker://s:train:0/weights/gone"}, sessions={"s": "default", "t": "team-a"},
        models={"s:train:0": Model("s:train:0", "tinker-s-0", "base", 8, version=3)}, lora={"s:train:0": {"rank": 8}},
        sampling={"sampler-1": {"owner": "default", "path": sampler_path},
                  "sampler-2": {"owner": "team-a", "base_model": "base"}},
        runs={"s:train:0": Run("s:train:0", "base", 8, {"rank": 8}, "default", 5.0, {sampler_path: 4.0})},
        restored={"tinker-restored-x": sampler_path}, on_rollout={"tinker-s-0": "default"})
    state.write(snapshot)
    assert state.load(KINDS) == snapshot
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["front.json"]  # no temporary left behind
    FrontState(None).write(snapshot)  # memory only: writes nothing


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "cannot be read"),
    (json.dumps({"version": 99}), "not a Tinker front state of version 1 or 2"),
    (json.dumps({"version": 2, "saved": {"p": {"checkpoint": "c"}}}), r"saved\['p'\] must hold \['adapter'"),
    (json.dumps({"version": 2, "saved": {"p": {"checkpoint": "c", "adapter": "a", "base_model": "b", "rank": 8,
                                               "lora": {}, "owner": "x"}}}),
     r"and may hold \['expires_at', 'tenant'\]"),
    (json.dumps({"version": 2, "sessions": ["s"]}), "a record of the wrong shape"),
])
def test_a_file_the_front_cannot_read_is_refused_by_name(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "front.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        FrontState(path).load(KINDS)
    assert path.read_text() == text  # never replaced


def test_a_path_keeps_its_tenant_and_a_file_from_before_tenants_reads_as_the_default_tenants(tmp_path: Path) -> None:
    """Only the tenant that saved a path may load it after a restart (lorarl.tinker.tenants); a state file written
    before tenants (and sessions) were kept, version 1, reads with its paths the one tenant's there was then."""
    state = FrontState(tmp_path / "front.json")
    saved = {"tinker://s:train:0/weights/a": Saved("ckpt/a", "export/a", "base", 8, {"rank": 8}, tenant="team-a")}
    state.write(Snapshot(saved=saved))
    assert state.load(KINDS).saved["tinker://s:train:0/weights/a"].tenant == "team-a"
    old = {"version": 1, "saved": {"tinker://s:train:0/weights/a": {"checkpoint": "c", "adapter": "a",
                                                                   "base_model": "b", "rank": 8, "lora": {}}}}
    state.path.write_text(json.dumps(old))
    kept = state.load(KINDS)
    assert kept.saved["tinker://s:train:0/weights/a"].tenant == "default" and kept.sessions == {}


def test_the_journal_gives_back_outcomes_fails_what_a_kill_caught_and_goes_on_in_seq_order(tmp_path: Path) -> None:
    async def before_the_kill(journal: Journal) -> tuple[str, str, str]:
        futures = Futures(hold_s=1, journal=journal)
        futures.start_model("m")

        async def value(payload):
            return payload

        async def never() -> dict:
            await asyncio.Event().wait()
            return {}

        first = futures.submit_ordered("m", 1, lambda: value({"step": 1}), "team-a")
        second = futures.submit_ordered("m", 2, lambda: value(b"\x08\x01"), "team-a")
        assert (await futures.retrieve(first, "team-a")).json == {"step": 1}
        assert (await futures.retrieve(second, "team-a")).proto == b"\x08\x01"
        caught = futures.submit_ordered("m", 3, never, "team-a")  # running when the front is killed
        await asyncio.sleep(0.01)
        return first, second, caught

    path = tmp_path / "front.json.requests.jsonl"
    first, second, caught = asyncio.run(before_the_kill(Journal(path)))  # the loop ends: a kill, for the futures
    with open(path, "a") as cut:
        cut.write('{"id": "req-cut", "owner"')  # a line the kill cut short: never answered as accepted

    async def after_the_restart() -> None:
        futures = Futures(hold_s=1, journal=Journal(path))
        futures.restore()
        futures.start_model("m")
        assert (await futures.retrieve(first, "team-a")).json == {"step": 1}
        assert (await futures.retrieve(second, "team-a")).proto == b"\x08\x01"
        with pytest.raises(KeyError):
            await futures.retrieve(first, "team-b")  # still its tenant's only
        failed = await futures.retrieve(caught, "team-a")
        assert failed.error == RESTARTED and failed.category == "user"
        assert futures.resubmitted("m", 2, "team-a") == second  # the SDK's retry: the first one's future
        assert futures.resubmitted("m", 2, "team-b") is None and futures.resubmitted("m", 4, "team-a") is None
        with pytest.raises(UserError, match="seq_id 3 of model 'm' was already used"):
            futures.submit_ordered("m", 3, lambda: asyncio.sleep(0), "team-a")

        async def fourth() -> dict:
            return {"step": 4}

        nxt = futures.submit_ordered("m", 4, fourth, "team-a")  # the model goes on after the lost seq_id
        assert (await futures.retrieve(nxt, "team-a")).json == {"step": 4}
        await futures.close()

    asyncio.run(after_the_restart())
    with open(path) as lines:
        ids = {json.loads(line)["id"] for line in lines}
    assert ids >= {first, second, caught} and "req-cut" not in ids
    path.write_text('{"id": "x", "owner": "a"}\nnot json\n{"id": "y", "owner": "a"}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:2: not a journal line"):
        Journal(path).replay()


def test_an_outcome_round_trips_as_a_journal_record() -> None:
    for outcome in (Outcome(json={"a": [1, 2]}), Outcome(proto=b"\x00\xff"), Outcome(error="bad", category="server")):
        assert Outcome.of_record(json.loads(json.dumps(outcome.record()))) == outcome


def test_a_long_running_front_compacts_its_journal_and_keeps_what_is_running(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its size the journal is rewritten while the front runs: old outcomes go (here: all finished ones, the
    keep window set to none), a running request and each model's last seq_id stay — and a request still running
    is not failed by it, only by a restart."""
    import lorarl.tinker.state as state_module

    monkeypatch.setattr(state_module, "KEEP_OUTCOMES_S", -1.0)
    path = tmp_path / "requests.jsonl"
    journal = Journal(path, max_bytes=4000)
    journal.accepted("running", "a", "m", 0)
    for seq in range(1, 80):
        journal.accepted(f"r{seq}", "a", "m", seq)
        journal.settled(f"r{seq}", {"json": {"seq": seq}})
    journal.close()
    assert path.stat().st_size < 4000
    with open(path) as lines:
        entries = [json.loads(line) for line in lines]
    assert {"id": "running", "owner": "a", "model": "m", "seq": 0} in entries
    assert not any(e.get("id") == "running" and "outcome" in e for e in entries)  # still running: not failed
    monkeypatch.setattr(state_module, "KEEP_OUTCOMES_S", 600.0)
    kept = Journal(path).replay()
    assert kept["running"].outcome["error"] == RESTARTED and kept["r79"].seq == 79 and "r1" not in kept
