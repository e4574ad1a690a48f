"""A saved tinker:// path's ttl_seconds (the cookbook saves its checkpoints with one): within it the path loads
and samples; past it, it is refused naming when it expired, then swept from the path table and the REST
listing; a ttl outside the SDK's documented 1 hour to 10 years is refused by name. No services are called: the
clock is the test's."""

from __future__ import annotations

import asyncio

import pytest

from lorarl.tinker.futures import UserError
from lorarl.tinker.service import Sampler, Saved, TinkerService

RUN = "s:train:0"
SAVED = f"tinker://{RUN}/weights/a"
SAMPLER = f"tinker://{RUN}/sampler_weights/v1"


def test_a_path_past_its_ttl_no_longer_loads_samples_or_lists() -> None:
    asyncio.run(a_path_past_its_ttl())  # the service's gRPC channels are made in a running loop


async def a_path_past_its_ttl() -> None:
    now = [1_000_000.0]
    service = TinkerService({"base": "/models/base"}, "127.0.0.1:1", wall_clock=lambda: now[0])
    session = service.create_session()["session_id"]
    service.runs.add(RUN, "base", 8, {"rank": 8}, owner="default")
    expires = service._expiry(3600)
    assert expires == now[0] + 3600
    service.saved[SAVED] = Saved("ckpt/a", "export/a", "base", 8, {"rank": 8}, expires_at=expires)
    service._paths[SAMPLER] = Sampler("base", "tinker-s-0", 1, SAMPLER, "export/v1", {"rank": 8}, expires_at=expires)
    service.runs.saved(SAVED, expires)
    service.runs.saved(SAMPLER, expires)
    assert service._saved({"path": SAVED}, "default").checkpoint == "ckpt/a"
    service.create_sampling_session({"session_id": session, "model_path": SAMPLER})
    assert service.expire_paths() == []

    now[0] += 3600
    with pytest.raises(UserError, match=rf"{SAVED} expired at .* \(its ttl_seconds\)"):
        service._saved({"path": SAVED}, "default")
    with pytest.raises(UserError, match="expired at"):
        service.create_sampling_session({"session_id": session, "model_path": SAMPLER})
    assert sorted(service.expire_paths()) == sorted([SAVED, SAMPLER])
    assert service.runs.checkpoints(RUN, owner="default")["checkpoints"] == []
    with pytest.raises(UserError, match="no sampler weights"):
        service.create_sampling_session({"session_id": session, "model_path": SAMPLER})
    with pytest.raises(UserError, match="no checkpoint at"):
        service._saved({"path": SAVED}, "default")


@pytest.mark.parametrize("ttl", [60, 3599, 10 * 365 * 24 * 3600 + 1, 7200.5, True, "3600"])
def test_a_ttl_outside_one_hour_to_ten_years_is_refused_by_name(ttl) -> None:
    async def check() -> None:
        service = TinkerService({"base": "/models/base"}, "127.0.0.1:1")
        with pytest.raises(UserError, match=r"ttl_seconds must be an integer from 3600 \(1 hour\) to 315360000"):
            service._expiry(ttl)
        assert service._expiry(None) == 0.0

    asyncio.run(check())
