"""The switch gate: a switch waits for submissions in progress and holds back new ones."""

from __future__ import annotations

import asyncio

from lorarl.rollout.gate import SwitchGate


def test_switch_waits_for_submitters_and_blocks_newcomers() -> None:
    async def main() -> list[str]:
        gate = SwitchGate()
        log: list[str] = []
        release_first = asyncio.Event()

        async def submitter(name: str, hold: asyncio.Event | None = None) -> None:
            async with gate.submitting():
                log.append(f"{name} in")
                if hold is not None:
                    await hold.wait()
            log.append(f"{name} out")

        async def switch() -> None:
            async with gate.switch():
                log.append("switch")
                await asyncio.sleep(0.01)
            log.append("switch done")

        first = asyncio.ensure_future(submitter("first", release_first))
        await asyncio.sleep(0)
        switching = asyncio.ensure_future(switch())
        await asyncio.sleep(0)
        late = asyncio.ensure_future(submitter("late"))
        await asyncio.sleep(0.01)
        assert gate.switching and log == ["first in"]
        release_first.set()
        await asyncio.gather(first, switching, late)
        return log

    assert asyncio.run(main()) == ["first in", "first out", "switch", "switch done", "late in", "late out"]
