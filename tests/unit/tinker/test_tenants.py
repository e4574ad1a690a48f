"""The Tinker front's tenants (lorarl/tinker/tenants.py): a key finds its tenant, each tenant's requests wait in
a queue of their own behind at most ``max_in_flight`` running ones, a full queue refuses before it accepts, a
future is retrievable only by its tenant, and the settings refuse what would mix two tenants up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lorarl.common.config import ConfigError
from lorarl.tinker.futures import Futures
from lorarl.tinker.server import TenantSettings, TinkerSettings
from lorarl.tinker.tenants import (
    DEFAULT_TENANT,
    Admission,
    FrontTenant,
    FrontTenants,
    TenantLimits,
    TooManyRequestsError,
)


def two() -> FrontTenants:
    """A flooding tenant (2 requests running, 3 waiting) and a quiet one with the default limits."""
    return FrontTenants([FrontTenant("flood", ("tml-flood",), TenantLimits(max_in_flight=2, max_waiting=3)),
                         FrontTenant("quiet", ("tml-quiet",))])


def test_a_key_finds_its_tenant_and_no_other() -> None:
    tenants = two()
    assert tenants.of_key("tml-flood").name == "flood" and tenants.of_key("tml-quiet").name == "quiet"
    assert tenants.of_key("tml-other") is None and tenants.of_key("") is None
    assert tenants["quiet"].job_prefix == "tinker-quiet-" and FrontTenants.single(["tml-a"])[
        DEFAULT_TENANT].job_prefix == "tinker-"


@pytest.mark.parametrize(("tenants", "message"), [
    ([FrontTenant("a", ("tml-x",)), FrontTenant("b", ("tml-x",))], "share an API key"),
    ([FrontTenant("a", ("tml-x",)), FrontTenant("a", ("tml-y",))], "distinct names"),
    ([FrontTenant("a", ("sk-x",))], "starting with 'tml-'"),
    ([FrontTenant("Team A", ("tml-x",))], "lower-case letters"),
])
def test_tenants_that_would_mix_up_are_refused(tenants: list[FrontTenant], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FrontTenants(tenants)


def test_a_flood_waits_behind_its_own_requests_and_past_its_queue_is_refused() -> None:
    """Flood: 2 running, 3 waiting, the 6th refused before it is accepted; quiet's request runs at once beside
    them (it never queues behind flood's), and flood's waiting ones run as its own finish."""
    async def body() -> None:
        admission = Admission(two())
        release = asyncio.Event()
        started: list[str] = []

        def work(name: str):
            async def run() -> str:
                started.append(name)
                if name.startswith("flood"):
                    await release.wait()
                return name
            return run

        tasks = [asyncio.create_task(admission.admitted("flood", work(f"flood-{i}"))()) for i in range(5)]
        with pytest.raises(TooManyRequestsError, match=r"tenant 'flood' has 2 requests running and 3 waiting"):
            admission.admitted("flood", work("flood-5"))
        await asyncio.sleep(0.01)
        assert started == ["flood-0", "flood-1"] and admission.running["flood"] == 2
        assert admission.pending["flood"] == 5
        assert await admission.admitted("quiet", work("quiet-0"))() == "quiet-0"  # not behind flood's queue
        release.set()
        assert await asyncio.gather(*tasks) == [f"flood-{i}" for i in range(5)]
        assert admission.pending["flood"] == 0 and admission.running["flood"] == 0
        admission.admitted("flood", work("flood-6"))  # room again
        admission.withdraw("flood")
        assert admission.pending["flood"] == 0

    asyncio.run(body())


def test_a_future_is_retrieved_only_by_its_tenant() -> None:
    async def body() -> None:
        futures = Futures(hold_s=1)

        async def work() -> dict:
            return {"ok": True}

        request_id = futures.submit(work, "quiet")
        with pytest.raises(KeyError):
            await futures.retrieve(request_id, "flood")  # answered as an unknown id
        assert (await futures.retrieve(request_id, "quiet")).json == {"ok": True}

    asyncio.run(body())


def test_the_settings_make_the_default_tenant_and_each_named_one(tmp_path: Path) -> None:
    key_file = tmp_path / "a.key"
    key_file.write_text("tml-a1\n\ntml-a2\n")
    trainer_key = tmp_path / "a.trainer"
    trainer_key.write_text("trainer-secret\n")
    settings = TinkerSettings(trainer="127.0.0.1:1", models={"m": "/m"}, api_keys=["tml-plain"], tenants=[
        TenantSettings(name="team-a", api_key_file=str(key_file), trainer_token_file=str(trainer_key),
                       max_models=2, max_in_flight=4)])
    settings.validate()
    tenants = settings.front_tenants()
    assert tenants.of_key("tml-plain").name == DEFAULT_TENANT and tenants.of_key("tml-a2").name == "team-a"
    team = tenants["team-a"]
    assert team.trainer_token == "trainer-secret" and team.limits == TenantLimits(2, 16, 4, 1024)
    assert tenants[DEFAULT_TENANT].trainer_token is None


@pytest.mark.parametrize(("tenant", "api_keys", "field", "message"), [
    (TenantSettings(name="default", api_keys=["tml-x"]), [], "name", "tenant of tinker.api_keys"),
    (TenantSettings(name="team a", api_keys=["tml-x"]), [], "name", "lower-case letters"),
    (TenantSettings(name="team-a"), [], "api_keys", "has no key"),
    (TenantSettings(name="team-a", api_keys=["tml-x"]), ["tml-x"], "tenants", "listed twice"),
])
def test_settings_that_would_mix_tenants_up_name_the_key(tenant: TenantSettings, api_keys: list[str], field: str,
                                                         message: str) -> None:
    settings = TinkerSettings(trainer="127.0.0.1:1", models={"m": "/m"}, api_keys=api_keys, tenants=[tenant])
    with pytest.raises(ConfigError, match=message) as caught:
        tenant.validate()
        settings.validate()
    assert field in str(caught.value)
