"""deploy/k8s: every overlay renders with the real Kustomize, validates against the Kubernetes schemas
(kubernetes-validate, strict), and agrees with the services' own configs (tools/k8s_check.py); each rule
is shown to catch the mistake it exists for."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import yaml

from tools.k8s_check import OVERLAYS, render, schema_problems, semantic_problems

RENDERED = {overlay: render(overlay) for overlay in OVERLAYS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_and_agrees_with_the_configs(overlay: str) -> None:
    docs = RENDERED[overlay]
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] != "ConfigMap")
    assert kinds == ["Job/lorarl-loop", "PersistentVolumeClaim/lorarl-runs", "Service/rollout", "Service/trainer",
                     "Service/weightsync", "StatefulSet/rollout", "StatefulSet/trainer", "StatefulSet/weightsync"]
    assert schema_problems(docs) == []
    assert semantic_problems(docs) == []


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name))


def container(docs: list[dict], kind: str, name: str) -> dict:
    return find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def set_env(c: dict, name: str, value: str) -> None:
    next(e for e in c["env"] if e["name"] == name)["value"] = value


def edit_config(docs: list[dict], file: str, change: Callable[[dict], None]) -> None:
    cm = find(docs, "ConfigMap", "lorarl-config")
    data = yaml.safe_load(cm["data"][file])
    change(data)
    cm["data"][file] = yaml.safe_dump(data)


MISTAKES: dict[str, tuple[str, Callable[[list[dict]], None], str]] = {
    "service port": ("cpu", lambda d: find(d, "Service", "trainer")["spec"]["ports"][0].update(port=50099),
                     "Service/trainer: port grpc must be 50051"),
    "container port": ("cpu", lambda d: container(d, "StatefulSet", "rollout")["ports"][0].update(containerPort=1),
                       "containerPort grpc is 1 but server.port is 50052"),
    "probe port": ("cpu", lambda d: container(d, "StatefulSet", "weightsync")["readinessProbe"]["grpc"].update(port=2),
                   "readinessProbe must be a gRPC health check on port 50053"),
    "secret name": ("cpu", lambda d: find(d, "StatefulSet", "trainer")["spec"]["template"]["spec"]["volumes"][1]
                    ["secret"].update(secretName="other"), "StatefulSet/trainer: must mount the Secret lorarl-token"),
    "token in env": ("cpu", lambda d: container(d, "StatefulSet", "trainer")["env"].append(
        {"name": "LORARL_SERVER__AUTH__TOKEN", "value": "x"}), "must come from the Secret file"),
    "weight sync address": ("cpu", lambda d: set_env(container(d, "StatefulSet", "rollout"),
                                                     "LORARL_ROLLOUT__WEIGHTSYNC_ADDRESS", "weightsync:1"),
                            "weightsync_address is 'weightsync:1'"),
    "unknown setting": ("cpu", lambda d: container(d, "StatefulSet", "rollout")["env"].append(
        {"name": "LORARL_ROLLOUT__NO_SUCH_KEY", "value": "1"}), "does not load"),
    "loop address": ("cpu", lambda d: container(d, "Job", "lorarl-loop")["args"].__setitem__(3, "trainer-0.trainer:1"),
                     "--trainer/--weightsync are trainer-0.trainer:1"),
    "state off volume": ("cpu", lambda d: edit_config(d, "trainer.yaml", lambda c: c["trainer"].update(
        checkpoint_dir="/tmp/ckpt")), "trainer.checkpoint_dir '/tmp/ckpt' is not on a persistent volume"),
    "job dtype": ("cpu", lambda d: edit_config(d, "job.yaml", lambda c: c["model"].update(dtype="bfloat16")),
                  "disagree on model.dtype / rollout.dtype"),
    "job window": ("cpu", lambda d: edit_config(d, "job.yaml", lambda c: c["loop"].update(max_staleness=1)),
                   "disagree on staleness.adapter_window"),
    "gpu request": ("cuda", lambda d: container(d, "StatefulSet", "trainer")["resources"].pop("limits"),
                    "StatefulSet/trainer: computes on cuda but requests no nvidia.com/gpu"),
    "npu on cpu job": ("cpu", lambda d: container(d, "StatefulSet", "rollout")["resources"].update(
        limits={"huawei.com/Ascend910": 1}), "requests huawei.com/Ascend910 but computes on cpu"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_rule_catches_its_mistake(mistake: str) -> None:
    overlay, change, expected = MISTAKES[mistake]
    docs = copy.deepcopy(RENDERED[overlay])
    change(docs)
    problems = semantic_problems(docs)
    assert any(expected in p for p in problems), problems


def test_the_schemas_refuse_an_unknown_field() -> None:
    docs = copy.deepcopy(RENDERED["cpu"])
    container(docs, "StatefulSet", "rollout")["imagePullPolice"] = "Always"
    assert any("imagePullPolice" in p for p in schema_problems(docs))
