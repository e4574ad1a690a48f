"""Checks deploy/'s Compose files without a Docker engine: the Compose schema, then lorarl's own rules.

    python -m tools.compose_check deploy/docker-compose.yml [deploy/docker-compose.ascend.yml ...]

The schema (deploy/schema/compose-spec.json, vendored from compose-spec/compose-spec) catches
unknown keys and wrong shapes. A schema cannot know that a `depends_on` target exists, that a
command parses with the real `lorarl` parser, that a config file and every LORARL_<SECTION>__<KEY>
variable name real settings (each service config is loaded as the service would load it), that a
client address uses the port its server listens on, that servers bind an address other
containers can reach, or that the token reaches every service as a mounted secret file (never an
environment variable, which `docker inspect` shows); the semantic checks below do. Container
paths under /app (the images' WORKDIR, where `COPY . .` puts the repository) are read from this
checkout, /run/secrets/NAME from the secret's file, and paths on a bind mount of a host directory
outside the repository (models, data) are taken to exist: the host provides them.

Under `network_mode: host` service names do not resolve: peers are addressed at 127.0.0.1 by port,
servers listen on loopback, and no two services may take one port. Ascend services (lorarl:ascend
image): those on hccl run with host networking and IPC; those without NPU devices keep torch from
loading torch_npu (TORCH_DEVICE_BACKEND_AUTOLOAD=0); the rollout's engine settings pass the rules
of lorarl/common/ascend.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jsonschema

from lorarl.common.config import (
    ENV_PREFIX,
    ENV_SEPARATOR,
    ConfigError,
    apply_env,
    apply_overrides,
    from_dict,
    read_yaml,
)
from tools.compose_file import ComposeError, depends_on, load

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "deploy" / "schema" / "compose-spec.json"
IMAGE_ROOT = "/app"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
SECRETS_DIR = "/run/secrets"
#: Environment variables that would put the token where `docker inspect` shows it.
TOKEN_VARIABLES = frozenset({"LORARL_AUTH_TOKEN", "LORARL_SERVER__AUTH__TOKEN"})
_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)")


# ----------------------------------------------------------------------------------- helpers


def schema_problems(project: Mapping[str, Any]) -> list[str]:
    """Every place `project` breaks the Compose Specification schema."""
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))
    return [f"{'.'.join(str(p) for p in error.absolute_path) or '<top>'}: {error.message}"
            for error in sorted(validator.iter_errors(project), key=lambda e: list(map(str, e.absolute_path)))]


def repo_path(path: str, working_dir: str = IMAGE_ROOT) -> Path:
    """Where a container path of the image lies in this checkout (relative paths: from working_dir)."""
    absolute = path if path.startswith("/") else f"{working_dir.rstrip('/')}/{path}"
    if absolute != IMAGE_ROOT and not absolute.startswith(IMAGE_ROOT + "/"):
        raise ValueError(f"{path!r} is not inside the image's {IMAGE_ROOT}")
    return ROOT / absolute[len(IMAGE_ROOT):].lstrip("/")


def secret_mounts(project: Mapping[str, Any], service: Mapping[str, Any], project_dir: Path) -> dict[str, Path]:
    """Container path -> host file of each file secret ``service`` mounts (Compose puts them under /run/secrets)."""
    declared = project.get("secrets") or {}
    mounts = {}
    for item in service.get("secrets") or []:
        source = item if isinstance(item, str) else item.get("source", "")
        target = source if isinstance(item, str) else item.get("target", source)
        spec = declared.get(source) or {}
        if "file" in spec:
            path = Path(spec["file"])
            mounts[target if target.startswith("/") else f"{SECRETS_DIR}/{target}"] = \
                path if path.is_absolute() else project_dir / path
    return mounts


_HOST_DATA = Path(tempfile.mkdtemp(prefix="lorarl-compose-check-"))


def data_mounts(service: Mapping[str, Any], project_dir: Path) -> dict[str, Path]:
    """Container directory -> stand-in directory here, for each bind mount of a host directory outside the
    repository (the host's models/ and data/): paths on them are taken to exist."""
    found = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, Mapping) or volume.count(":") < 1:
            continue
        source, target = volume.split(":")[:2]
        if not source.startswith((".", "/")):
            continue  # a named volume
        host = (project_dir / source).resolve() if not source.startswith("/") else Path(source)
        if not host.is_relative_to(ROOT) or not host.exists():
            found[target.rstrip("/")] = _HOST_DATA / target.strip("/").replace("/", "_")
    return found


def _to_repo(value: Any, mounts: Mapping[str, Path] | None = None) -> Any:
    """Config data with /app/... strings (and mounted secrets, and paths on host data mounts) read as
    paths here, so existence checks apply."""
    if isinstance(value, str) and mounts and value in mounts:
        return str(mounts[value])
    for target, stand_in in (mounts or {}).items():
        if isinstance(value, str) and value.startswith(target + "/"):
            path = stand_in / value[len(target) + 1:]
            path.mkdir(parents=True, exist_ok=True)
            return str(path)
    if isinstance(value, str) and (value == IMAGE_ROOT or value.startswith(IMAGE_ROOT + "/")):
        return str(repo_path(value))
    if isinstance(value, dict):
        return {k: _to_repo(v, mounts) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_repo(v, mounts) for v in value]
    return value


def parse_command(command: Sequence[str]) -> argparse.Namespace:
    """`lorarl <command>` parsed by the real CLI parser; ValueError with argparse's message if it fails."""
    from lorarl.client.cli import build_parser

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(list(command))
    except SystemExit:
        lines = errors.getvalue().strip().splitlines() or ["not a lorarl command line"]
        raise ValueError(lines[-1]) from None


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's environment as a mapping (Compose allows a list of NAME=VALUE too)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def service_config(service: Mapping[str, Any], args: argparse.Namespace,
                   mounts: Mapping[str, Path] | None = None) -> Any:
    """The config `lorarl serve` builds from this service's config file, environment and flags
    (``mounts``: its secrets, see secret_mounts)."""
    from lorarl.client.commands.serve import SERVICES, flag_overrides

    config_type = importlib.import_module(SERVICES[args.service]).CONFIG_TYPE
    working_dir = service.get("working_dir", IMAGE_ROOT)
    raw = _to_repo(read_yaml(repo_path(args.config, working_dir)), mounts) if args.config else {}
    env = {k: str(_to_repo(v, mounts)) for k, v in environment(service).items()}
    apply_env(raw, config_type, env)
    apply_overrides(raw, [*args.overrides, *flag_overrides(args)])
    return from_dict(config_type, raw)


def strings(value: Any) -> Iterator[str]:
    """Every string inside a service definition."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def _volume_targets(service: Mapping[str, Any]) -> list[str]:
    targets = []
    for volume in service.get("volumes") or []:
        targets.append(volume.get("target", "") if isinstance(volume, Mapping) else volume.split(":")[1])
    return targets


# ----------------------------------------------------------------------------------- checks


def semantic_problems(project: Mapping[str, Any], project_dir: Path) -> list[str]:
    """What the schema cannot see; see the module docstring."""
    services: Mapping[str, Any] = project.get("services") or {}
    missing = _secret_problems(project, project_dir)
    if missing:  # no container would start: say that once, not once per service that mounts it
        return missing
    problems: list[str] = []
    configs: dict[str, Any] = {}
    for name, service in services.items():
        where = f"services.{name}"
        problems += [f"{where}.depends_on: no service {dep!r}" for dep in depends_on(service) if dep not in services]
        problems += [f"{where}.secrets: no top-level secret {source!r}" for source in _secret_names(service)
                     if source not in (project.get("secrets") or {})]
        problems += [f"{where}.environment.{key}: the token would show in `docker inspect`; mount it as a secret "
                     "and read it with server.auth.token_file (--token-file for the client)"
                     for key in environment(service) if key in TOKEN_VARIABLES]
        problems += _build_problems(where, service, project_dir)
        problems += _logging_problems(where, service)
        try:
            args = parse_command(service.get("command") or [])
        except ValueError as exc:
            problems.append(f"{where}.command: `lorarl {' '.join(service.get('command') or [])}` does not parse: {exc}")
            continue
        mounts = {**secret_mounts(project, service, project_dir), **data_mounts(service, project_dir)}
        problems += _ascend_problems(where, service)
        if args.command == "serve":
            problems += _server_problems(where, name, service, args, configs, mounts)
        elif args.command == "train":
            problems += _client_problems(where, service, args, mounts)
    for name, service in services.items():
        problems += _address_problems(f"services.{name}", name, service, services, configs)
    problems += _host_port_problems(services, configs)
    return problems


#: Logging drivers that keep a container's output on the host, and so must be told when to rotate it.
LOCAL_LOG_DRIVERS = ("json-file", "local")


def _logging_problems(where: str, service: Mapping[str, Any]) -> list[str]:
    """A service whose output Docker keeps on the host without a size cap fills the disk over days (Docker's
    default json-file driver never rotates): the stack keeps each log as `lorarl run` keeps a service log."""
    logging_ = service.get("logging") or {}
    driver = logging_.get("driver", "json-file")
    if driver not in LOCAL_LOG_DRIVERS:
        return []  # syslog, journald, fluentd...: rotated where they deliver
    if "max-size" not in (logging_.get("options") or {}):
        return [f"{where}.logging: the {driver} driver keeps the container's output without a size cap; set "
                "options.max-size (and max-file)"]
    return []


def host_networked(service: Mapping[str, Any]) -> bool:
    return service.get("network_mode") == "host"


def _ascend_problems(where: str, service: Mapping[str, Any]) -> list[str]:
    if "ascend" not in str(service.get("image", "")):
        return []
    env = environment(service)
    problems = []
    uses_hccl = any("hccl" in value or (key.endswith("__DEVICE") and value.startswith("npu"))
                    for key, value in env.items() if key.startswith(ENV_PREFIX))
    if uses_hccl and not (host_networked(service) and service.get("ipc") == "host"):
        problems.append(f"{where}: uses hccl but not host networking and IPC (network_mode: host, ipc: host); "
                        "HCCL across a bridge network is unproven, vllm-ascend and AReaL run on the host's")
    if not service.get("devices") and env.get("TORCH_DEVICE_BACKEND_AUTOLOAD") != "0":
        problems.append(f"{where}: the Ascend image without NPU devices: set TORCH_DEVICE_BACKEND_AUTOLOAD: \"0\" "
                        "(torch's automatic torch_npu load fails without the driver's libascend_hal.so)")
    return problems


def _host_port_problems(services: Mapping[str, Any], configs: Mapping[str, Any]) -> list[str]:
    """Host-networked servers share the host's ports."""
    taken: dict[int, str] = {}
    problems = []
    for name, config in configs.items():
        if config is None or not host_networked(services[name]):
            continue
        for port in (config.server.port, config.server.metrics_port):
            if port in taken:
                problems.append(f"services.{name}: port {port} is {taken[port]}'s too (both on the host's network)")
            taken[port] = name
    return problems


def _secret_names(service: Mapping[str, Any]) -> list[str]:
    return [item if isinstance(item, str) else item.get("source", "") for item in service.get("secrets") or []]


def _secret_problems(project: Mapping[str, Any], project_dir: Path) -> list[str]:
    """Declared file secrets whose file is missing or empty (Compose would refuse to create the containers)."""
    problems = []
    for name, spec in (project.get("secrets") or {}).items():
        if "file" not in spec:
            continue
        path = Path(spec["file"]) if Path(spec["file"]).is_absolute() else project_dir / spec["file"]
        if not path.is_file() or not path.read_text(encoding="utf-8", errors="replace").strip():
            problems.append(f"secrets.{name}.file: {path} {'is empty' if path.is_file() else 'does not exist'}; "
                            "create it with the shared token, e.g. (umask 077; openssl rand -hex 16 > FILE), "
                            "see deploy/README.md")
    return problems


def _build_problems(where: str, service: Mapping[str, Any], project_dir: Path) -> list[str]:
    build = service.get("build")
    if build is None:
        return []
    context = project_dir / (build if isinstance(build, str) else build.get("context", "."))
    dockerfile = context / ("Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile"))
    if not context.is_dir():
        return [f"{where}.build.context: {context} is not a directory"]
    if not dockerfile.is_file():
        return [f"{where}.build.dockerfile: {dockerfile} does not exist"]
    entrypoints = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    if not entrypoints or "lorarl" not in entrypoints[-1]:
        return [f"{where}.build: {dockerfile.name} has no lorarl ENTRYPOINT, so `command` is not lorarl's"]
    return []


def _server_problems(where: str, name: str, service: Mapping[str, Any], args: argparse.Namespace,
                     configs: dict[str, Any], mounts: Mapping[str, Path]) -> list[str]:
    configs[name] = None  # a server whose config fails is reported once, not again by every address of it
    if args.config and not repo_path(args.config, service.get("working_dir", IMAGE_ROOT)).is_file():
        return [f"{where}.command: config file {args.config} is not in the repository"]
    try:
        config = configs[name] = service_config(service, args, mounts)
    except ConfigError as exc:
        return [f"{where}: lorarl serve {args.service} would refuse its configuration: {exc}"]
    env = environment(service)
    sections = set(vars(config))
    problems = [f"{where}.environment.{key}: {args.service} has no config section {_section(key)!r}"
                for key in env if _section(key) is not None and _section(key) not in sections]
    auth = config.server.auth
    if auth.token is not None:
        problems.append(f"{where}: server.auth.token holds the token in the config file; use a secret and "
                        "server.auth.token_file")
    elif auth.token_file is None:
        # the service fails closed: no token, no start (auth.required: false holds on loopback only); and a
        # token in a variable would show in `docker inspect`
        problems.append(f"{where}: no server.auth.token_file: mount the token as a secret and name its "
                        f"{SECRETS_DIR}/<secret> path there")
    if host_networked(service):
        if config.server.host not in LOOPBACK_HOSTS:
            problems.append(f"{where}: server.host {config.server.host!r} on host networking listens on the host's "
                            "interfaces; use 127.0.0.1 (the stack is on one node)")
        for key, value in _advertised_hosts(config).items():
            if value and value not in LOOPBACK_HOSTS:
                problems.append(f"{where}: {key} {value!r}: on host networking peers reach this service at 127.0.0.1")
    else:
        if config.server.host not in WILDCARD_HOSTS:
            problems.append(f"{where}: server.host {config.server.host!r} is unreachable from other containers")
        for key, value in _advertised_hosts(config).items():
            if value and value != name:
                problems.append(f"{where}: {key} {value!r} is not this service's name ({name!r})")
    if "ascend" in str(service.get("image", "")) and hasattr(config, "rollout"):
        from lorarl.common import ascend

        problems += [f"{where}: {p}" for p in ascend.rollout_problems(
            config.rollout.block_size, config.rollout.dtype, block_key="rollout.block_size", dtype_key="rollout.dtype")]
    return problems


def _section(env_name: str) -> str | None:
    """The config section a LORARL_<SECTION>__<KEY> variable targets (None for other variables)."""
    rest = env_name[len(ENV_PREFIX):]
    if not env_name.startswith(ENV_PREFIX) or ENV_SEPARATOR not in rest:
        return None
    return rest.split(ENV_SEPARATOR)[0].lower()


def _advertised_hosts(config: Any) -> dict[str, str]:
    """Addresses a service tells its peers to reach it at (collective groups)."""
    hosts = {}
    if hasattr(config, "trainer"):
        hosts["trainer.sender_host"] = config.trainer.sender_host
    if hasattr(config, "rollout"):
        hosts["rollout.sync_host"] = config.rollout.sync_host
    return hosts


def _client_problems(where: str, service: Mapping[str, Any], args: argparse.Namespace,
                     mounts: Mapping[str, Path]) -> list[str]:
    from lorarl.client.job.config import load_job_config

    working_dir = service.get("working_dir", IMAGE_ROOT)
    job_file = repo_path(args.config, working_dir)
    if not job_file.is_file():
        return [f"{where}.command: job file {args.config} is not in the repository"]
    try:
        job = load_job_config(str(job_file), list(args.overrides))
    except ConfigError as exc:
        return [f"{where}: lorarl train would refuse the job: {exc}"]
    env = environment(service)
    problems = [f"{where}.environment.{key}: lorarl train reads no LORARL_<SECTION>__<KEY> variables"
                for key in env if _section(key) is not None]
    token_file = args.token_file or env.get("LORARL_AUTH_TOKEN_FILE")
    if not token_file:
        problems.append(f"{where}.command: lorarl train gets no token; pass --token-file {SECRETS_DIR}/<secret>")
    elif token_file not in mounts:
        problems.append(f"{where}.command: --token-file {token_file} is no secret this service mounts "
                        f"({', '.join(sorted(mounts)) or 'it mounts none'})")
    output = job.output.dir if job.output.dir.startswith("/") else f"{working_dir}/{job.output.dir}"
    if not any(output == t or output.startswith(t.rstrip("/") + "/") for t in _volume_targets(service)):
        problems.append(f"{where}: output.dir {output} is on no volume, so the run is lost with the container")
    return problems


def _address_problems(where: str, name: str, service: Mapping[str, Any], services: Mapping[str, Any],
                      configs: Mapping[str, Any]) -> list[str]:
    """host:port strings name a served port: another service's gRPC port, or this one's (healthcheck)."""
    problems = []
    for text in strings({k: v for k, v in service.items() if k != "ports"}):
        match = _ADDRESS.fullmatch(text)
        if match is None:
            continue
        host, port = match["host"], int(match["port"])
        target = name if host in LOOPBACK_HOSTS else host
        if host_networked(service) and host in LOOPBACK_HOSTS:  # the host's port: whichever peer serves it
            target = next((peer for peer, config in configs.items() if config is not None
                           and host_networked(services[peer]) and config.server.port == port), None)
            if target is None:
                problems.append(f"{where}: {text}: no service on the host's network listens on port {port}")
                continue
        elif host_networked(service) and host in services:
            problems.append(f"{where}: {text}: on host networking service names do not resolve; use 127.0.0.1:{port}")
            continue
        if target not in services:
            continue
        if target not in configs:
            problems.append(f"{where}: {text} names {target}, which runs no lorarl server")
        elif configs[target] is not None and configs[target].server.port != port:
            problems.append(f"{where}: {text} but {target} listens on port {configs[target].server.port}")
    if configs.get(name) is not None:
        served = {configs[name].server.port, configs[name].server.metrics_port}
        for mapping in service.get("ports") or []:
            container_port = int(str(mapping.get("target") if isinstance(mapping, Mapping) else mapping)
                                 .split(":")[-1].split("/")[0])
            if container_port not in served:
                problems.append(f"{where}.ports: {mapping} publishes {container_port}, which {name} does not serve")
    return problems


# ----------------------------------------------------------------------------------- entry


def check(paths: Sequence[str | os.PathLike[str]], env: Mapping[str, str]) -> list[str]:
    """Problems of the project made of these Compose files (merged in order), schema first."""
    try:
        project = load(paths, env)
    except ComposeError as exc:
        return [str(exc)]
    problems = schema_problems(project)
    return problems or semantic_problems(project, Path(paths[0]).resolve().parent)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compose_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="Compose files, merged in order like docker compose -f A -f B")
    args = parser.parse_args(argv)
    problems = check(args.files, os.environ)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(problems)} problem(s)" if problems else "ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
