"""A distillation teacher that is another job's published version (``distill.teachers[].job: JOB@vN``, #47): read
from the real weight-sync service (on loopback) by the real client code the loop runs at its start, written as a
PEFT directory in the student's output folder, and refused by the teacher's key when weight sync cannot give it: a
version no longer kept (the message names the kept ones), a job it never heard of, one trained on another base, no
weight sync at all. A later start reuses the copy it kept. A job that syncs merged versions teaches too: weight sync
keeps its versions' adapters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lorarl.client.calls import NamedStub
from lorarl.client.job.config import load_job_config
from lorarl.client.job.inputs import job_teachers
from lorarl.client.launch.local import lorarl_command
from lorarl.client.rl.teacher_versions import read_version_teachers
from lorarl.common.channel import aio_channel
from lorarl.common.config import ConfigError
from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.contract.lora import LoraSpec
from lorarl.contract.peft import fit_problems, read_peft_config, read_peft_tensors
from lorarl.v1 import common_pb2, weightsync_pb2_grpc
from lorarl.weightsync.client.publisher import WeightPublisher
from lorarl.weightsync.wire.catalog import catalog_from_tensors
from tests.integration.weightsync.harness import TOKEN, running_service
from tests.unit.rollout.models import LORA, dense_model_dir, random_adapter

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]


def student_config(tmp_path: Path, job: str):
    """examples/distill/two-tasks/student.yaml on the shipped tiny model, its add teacher ``job`` (its sort teacher an
    adapter directory, left as it is by the read)."""
    from tests.unit.clients.test_distill_job import teacher_dir

    raw = yaml.safe_load((ROOT / "examples" / "distill" / "two-tasks" / "student.yaml").read_text())
    raw["model"]["path"] = str(dense_model_dir())
    raw["distill"]["teachers"][0]["adapter"] = str(teacher_dir(tmp_path / "sort"))
    raw["distill"]["teachers"][1] = {"name": "add", "job": job, "domain": "add"}
    path = tmp_path / "student.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_job_config(str(path), [])


def test_a_jobs_published_version_becomes_the_students_teacher_adapter(tmp_path: Path) -> None:
    model = dense_model_dir()
    base = load_file(str(model / "model.safetensors"))
    versions = {v: random_adapter(model, seed=v) for v in (1, 2, 3)}

    async def scenario() -> None:
        async with running_service(tmp_path / "ws", keep_versions=2) as (running, _), \
                WeightPublisher(running.address, token=TOKEN, collective=False) as pub:
            catalog = catalog_from_tensors(base.items())
            await pub.register_job("expert", base_model_fingerprint=base_model_fingerprint(model),
                                   lora=LORA.to_proto(), catalog=catalog, mode=common_pb2.SYNC_MODE_ADAPTER)
            for v, tensors in versions.items():
                assert (await pub.publish("expert", v, adapter=tensors)).activation.ok
            await pub.register_job("merged", base_model_fingerprint=base_model_fingerprint(model),
                                   lora=LORA.to_proto(), catalog=catalog, mode=common_pb2.SYNC_MODE_MERGED)
            await pub.publish("merged", 1, adapter=versions[1], merged=lambda: base)
            await pub.register_job("elsewhere", base_model_fingerprint="another-base", lora=LORA.to_proto(),
                                   catalog=catalog, mode=common_pb2.SYNC_MODE_ADAPTER)
            await pub.publish("elsewhere", 1, adapter=versions[1])
            async with aio_channel(running.address, token=TOKEN) as channel:
                stub = NamedStub(weightsync_pb2_grpc.WeightSyncServiceStub(channel), "weightsync", running.address)

                async def read(job: str, token: str | None = TOKEN, weightsync=stub, out: str = "out"):
                    cfg = student_config(tmp_path, job)
                    return await read_version_teachers(cfg, job_teachers(cfg), weightsync, token, tmp_path / out)

                sort, add = await read("expert@v3")
                assert sort.version_of is None and sort.path.endswith("sort")  # an adapter teacher: as it was
                assert add.version_of is None and not add.own_engine and add.lora is not None
                assert Path(add.path) == tmp_path / "out" / "teachers" / "add"
                written = read_peft_tensors(add.path)
                assert written.keys() == versions[3].keys()
                assert all(torch.equal(written[k], versions[3][k]) for k in written)
                spec = LoraSpec.from_peft_config(read_peft_config(add.path))
                assert (spec.rank, spec.alpha) == (add.lora.rank, add.lora.alpha) == (LORA.rank, LORA.alpha)
                assert fit_problems(add.path, model) == []  # loads on the student's base as PEFT reads it

                refusals = [
                    ("expert@v1", "does not hold expert v1"),  # kept: v2, v3 (keep_versions 2)
                    ("expert@v9", "does not hold expert v9"),
                    ("nobody@v1", "no job 'nobody'"),
                    ("elsewhere@v1", "trained on another base model"),
                ]
                for job, words in refusals:
                    with pytest.raises(ConfigError) as refused:
                        await read(job, out="elsewhere")
                    assert refused.value.key == "distill.teachers[1].job" and words in str(refused.value), refused.value
                with pytest.raises(ConfigError, match="does not hold expert v1") as refused:
                    await read("expert@v1", out="elsewhere")
                assert "[2, 3]" in str(refused.value)  # the versions it keeps, named
                # a later start reuses the copy it kept (no weight sync needed: the owner's stack may be gone);
                # another version in the job file, or --fresh, reads it again
                (_, again) = await read("expert@v3", weightsync=None)
                assert again.path == add.path and again.lora == add.lora
                with pytest.raises(ConfigError, match="has none"):
                    await read("expert@v2", weightsync=None)
                with pytest.raises(ConfigError, match="has none"):
                    cfg = student_config(tmp_path, "expert@v3")
                    await read_version_teachers(cfg, job_teachers(cfg), None, TOKEN, tmp_path / "out", fresh=True)
                # a job that syncs merged versions: weight sync keeps each version's adapter, which teaches as well
                _, merged = await read("merged@v1", out="merged")
                assert all(torch.equal(read_peft_tensors(merged.path)[k], versions[1][k]) for k in versions[1])
                with pytest.raises(ConfigError, match="has none"):  # nothing kept, nowhere to read it from
                    await read("expert@v3", weightsync=None, out="new")
                # the CLI: `lorarl train` against these services ends by the teacher's key, before any job exists
                cfg_file = tmp_path / "student.yaml"
                student_config(tmp_path, "expert@v1")  # rewrites cfg_file: a version weight sync no longer keeps
                token_file = tmp_path / "token"
                token_file.write_text(TOKEN)
                done = await asyncio.create_subprocess_exec(
                    *lorarl_command(), "train", str(cfg_file), f"output.dir={tmp_path / 'cli'}", "--trainer",
                    "127.0.0.1:9", "--rollout", "127.0.0.1:9", "--weightsync", running.address, "--token-file",
                    str(token_file), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await done.communicate()
                assert done.returncode == 2, out.decode()[-2000:] + err.decode()[-2000:]
                assert "bad config: distill.teachers[1].job" in err.decode() and "does not hold expert v1" in \
                    err.decode(), err.decode()[-2000:]
                assert not (tmp_path / "cli" / "state.json").exists()  # no job was started

    asyncio.run(scenario())
