"""The typed config loader: layer precedence, and errors that name the full dotted key."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from lorarl.common.config import (
    ConfigError,
    dump_yaml,
    from_dict,
    in_range,
    load_config,
    parse_override,
    setting,
    to_dict,
)
from lorarl.common.server_config import ServerConfig
from lorarl.rollout.config import RolloutServiceConfig
from lorarl.trainer.service.config import TrainerServiceConfig
from lorarl.weightsync.service.config import WeightSyncServiceConfig


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Inner:
    ratio: float = setting(0.5, check=in_range(0.0, 1.0))
    names: list[str] = field(default_factory=list)
    color: Color = Color.RED


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    mode: Literal["fast", "slow"] = "fast"
    limit: int | None = None
    tags: dict[str, int] = field(default_factory=dict)
    pair: tuple[int, int] = (1, 2)
    nested: Inner | None = None


@dataclass
class CrossChecked:
    low: int = 0
    high: int = 10

    def validate(self) -> None:
        if self.low > self.high:
            raise ConfigError("low", f"must be <= high ({self.high})")


@dataclass
class HasCrossChecked:
    section: CrossChecked = field(default_factory=CrossChecked)


@dataclass
class NonDefaultSection:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50051, host="0.0.0.0"))


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_for(call, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    return info.value


# ---- precedence


def test_defaults_apply_without_file_env_or_overrides() -> None:
    config = load_config(TrainerServiceConfig, env={})
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 0
    assert config.server.max_message_bytes == 256 * 1024 * 1024
    assert config.server.auth.token_env == "LORARL_AUTH_TOKEN"
    assert config.trainer.device == "cpu"


def test_yaml_then_env_then_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"server": {"port": 1000, "host": "0.0.0.0", "shutdown_grace_s": 3}, "trainer": {"device": "cuda:1"}},
    )
    env = {"LORARL_SERVER__PORT": "2000", "LORARL_SERVER__LOG_LEVEL": "debug"}
    config = load_config(TrainerServiceConfig, path, env=env, overrides=["server.port=3000"])
    assert config.server.port == 3000  # override beats env beats file
    assert config.server.log_level == "debug"  # env beats default
    assert config.server.host == "0.0.0.0"  # file beats default
    assert config.server.shutdown_grace_s == 3.0
    assert isinstance(config.server.shutdown_grace_s, float)
    assert config.trainer.device == "cuda:1"

    only_env = load_config(TrainerServiceConfig, path, env=env)
    assert only_env.server.port == 2000


def test_later_overrides_win_and_nested_env_keys(tmp_path: Path) -> None:
    env = {"LORARL_SERVER__AUTH__REQUIRED": "true", "LORARL_SERVER__TLS__CERT_FILE": ""}
    config = load_config(
        TrainerServiceConfig, env=env, overrides=["server.port=1", "server.port=2", "server.metrics_port=-1"]
    )
    assert config.server.port == 2
    assert config.server.auth.required is True
    assert config.server.tls.cert_file is None  # empty text means null for optional fields
    assert config.server.metrics_port == -1
    assert not config.server.metrics_enabled


def test_text_values_are_parsed_by_field_type() -> None:
    config = load_config(
        Outer,
        env={},
        overrides=[
            "inner.names=[a, b]",
            "inner.ratio=0.25",
            "inner.color=BLUE",
            "limit=null",
            "tags={x: 1}",
            "pair=[3, 4]",
        ],
    )
    assert config.inner.names == ["a", "b"]
    assert config.inner.ratio == 0.25
    assert config.inner.color is Color.BLUE
    assert config.limit is None
    assert config.tags == {"x": 1}
    assert config.pair == (3, 4)


def test_string_fields_keep_text_verbatim() -> None:
    config = load_config(ServerConfig, env={}, overrides=["ready_file=/tmp/a: b=c.json", "host=::1"])
    assert config.ready_file == "/tmp/a: b=c.json"
    assert config.host == "::1"


def test_env_for_other_services_is_ignored_but_typos_in_known_sections_fail() -> None:
    config = load_config(RolloutServiceConfig, env={"LORARL_TRAINER__DEVICE": "cuda", "LORARL_AUTH_TOKEN": "x"})
    assert config.rollout.model_path is None
    err = error_for(load_config, RolloutServiceConfig, env={"LORARL_SERVER__PROT": "1"})
    assert err.key == "server.prot"
    assert "LORARL_SERVER__PROT" in str(err)


def test_partial_section_keeps_non_default_section_defaults() -> None:
    config = load_config(NonDefaultSection, env={}, overrides=["server.log_level=debug"])
    assert config.server.port == 50051
    assert config.server.host == "0.0.0.0"
    assert config.server.log_level == "debug"


def test_empty_section_means_defaults_and_floats_accept_exponents(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("server:\n  # port: 1\ntrainer:\n")
    config = load_config(TrainerServiceConfig, path, env={})
    assert config == TrainerServiceConfig()
    path.write_text("server:\n  keepalive_time_s: 1e2\n")  # YAML 1.1 reads this as a string
    assert load_config(TrainerServiceConfig, path, env={}).server.keepalive_time_s == 100.0


def test_nested_optional_section_is_built_from_overrides() -> None:
    config = load_config(Outer, env={}, overrides=["nested.ratio=0.75"])
    assert config.nested is not None and config.nested.ratio == 0.75


# ---- errors name the dotted key


def test_unknown_key_is_an_error_with_suggestion(tmp_path: Path) -> None:
    err = error_for(load_config, TrainerServiceConfig, write(tmp_path, {"server": {"prot": 5}}), env={})
    assert err.key == "server.prot"
    assert "did you mean 'port'" in str(err)
    err = error_for(load_config, TrainerServiceConfig, write(tmp_path, {"trainr": {}}), env={})
    assert err.key == "trainr"


@pytest.mark.parametrize(
    ("data", "key", "expected"),
    [
        ({"server": {"port": "http"}}, "server.port", "an integer"),
        ({"server": {"port": True}}, "server.port", "an integer"),
        ({"server": {"port": 1.5}}, "server.port", "an integer"),
        ({"server": {"host": 127}}, "server.host", "a string"),
        ({"server": {"auth": {"required": "yes please"}}}, "server.auth.required", "true or false"),
        ({"server": {"auth": "token"}}, "server.auth", "a section"),
        ({"server": {"shutdown_grace_s": None}}, "server.shutdown_grace_s", "a number"),
        ({"server": {"log_format": "xml"}}, "server.log_format", "'json', 'text'"),
        ({"server": "port 80"}, "server", "a section"),
        ({"server": {"keepalive_time_s": "often"}}, "server.keepalive_time_s", "a number"),
    ],
)
def test_wrong_type_names_the_key(tmp_path: Path, data: dict, key: str, expected: str) -> None:
    err = error_for(load_config, TrainerServiceConfig, write(tmp_path, data), env={})
    assert err.key == key
    assert expected in err.problem


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("server.port=70000", "server.port", "0..65535"),
        ("server.port=-1", "server.port", "0..65535"),
        ("server.metrics_port=-2", "server.metrics_port", "-1 or null to disable"),
        ("server.shutdown_grace_s=-1", "server.shutdown_grace_s", ">= 0.0"),
        ("server.max_message_bytes=10", "server.max_message_bytes", "1024"),
        ("server.tls.cert_file=/definitely/missing.pem", "server.tls.cert_file", "does not exist"),
        ("server.auth.token_file=/definitely/missing", "server.auth.token_file", "does not exist"),
        ("trainer.device=gpu", "trainer.device", "a device like"),
    ],
)
def test_bad_value_names_the_key(override: str, key: str, expected: str) -> None:
    err = error_for(load_config, TrainerServiceConfig, env={}, overrides=[override])
    assert err.key == key
    assert expected in err.problem
    assert f"override {override!r}" in str(err)


def test_bad_values_in_other_service_sections(tmp_path: Path) -> None:
    err = error_for(load_config, RolloutServiceConfig, env={}, overrides=[f"rollout.model_path={tmp_path}/no"])
    assert err.key == "rollout.model_path"
    assert load_config(RolloutServiceConfig, env={}, overrides=[f"rollout.model_path={tmp_path}"])
    err = error_for(load_config, WeightSyncServiceConfig, env={}, overrides=["weightsync.keep_versions=0"])
    assert err.key == "weightsync.keep_versions"
    err = error_for(load_config, RolloutServiceConfig, env={}, overrides=["rollout.block_size=40"])
    assert err.key == "rollout.block_size" and "a multiple of 16, got 40" in err.problem
    assert load_config(RolloutServiceConfig, env={}, overrides=["rollout.block_size=48"]).rollout.block_size == 48


def test_cross_field_rules(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    err = error_for(load_config, ServerConfig, env={}, overrides=[f"tls.cert_file={cert}"])
    assert err.key == "tls.key_file"
    err = error_for(load_config, ServerConfig, env={}, overrides=[f"tls.client_ca_file={cert}"])
    assert err.key == "tls.client_ca_file"
    err = error_for(load_config, ServerConfig, env={}, overrides=["port=9000", "metrics_port=9000"])
    assert err.key == "metrics_port"
    err = error_for(from_dict, HasCrossChecked, {"section": {"low": 5, "high": 1}})
    assert err.key == "section.low"
    err = error_for(load_config, ServerConfig, env={}, overrides=["host="])
    assert err.key == "host" and "must not be empty" in err.problem
    err = error_for(from_dict, ServerConfig, {"auth": {"token": " "}})
    assert err.key == "auth.token" and "must not be empty" in err.problem


def test_list_items_and_mapping_values_are_checked() -> None:
    err = error_for(from_dict, Outer, {"inner": {"names": ["a", 2]}})
    assert err.key == "inner.names[1]"
    err = error_for(from_dict, Outer, {"tags": {"x": "one"}})
    assert err.key == "tags.x"
    err = error_for(from_dict, Outer, {"inner": {"color": "green"}})
    assert err.key == "inner.color" and "'red', 'blue'" in err.problem


def test_required_fields_must_be_given() -> None:
    @dataclass
    class Needs:
        path: str

    err = error_for(from_dict, Needs, {})
    assert err.key == "path" and "missing required key" in err.problem
    assert from_dict(Needs, {"path": "x"}).path == "x"


def test_file_problems(tmp_path: Path) -> None:
    err = error_for(load_config, ServerConfig, tmp_path / "absent.yaml", env={})
    assert "not found" in str(err)
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [unclosed\n")
    assert "not valid YAML" in str(error_for(load_config, ServerConfig, bad, env={}))
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert "must hold a mapping" in str(error_for(load_config, ServerConfig, listing, env={}))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(ServerConfig, empty, env={}) == ServerConfig()


@pytest.mark.parametrize("override", ["no-equals-sign", "=value", "bad key=1", "a..b=1"])
def test_malformed_overrides(override: str) -> None:
    with pytest.raises(ConfigError, match=r"must look like key\.sub=value"):
        parse_override(override)


def test_override_below_a_scalar_is_an_error() -> None:
    err = error_for(load_config, ServerConfig, env={}, overrides=["port=1", "port.x=2"])
    assert err.key == "port"


# ---- dumping


def test_to_dict_and_dump_round_trip(tmp_path: Path) -> None:
    config = load_config(Outer, env={}, overrides=["inner.color=blue", "limit=3", "pair=[5, 6]", "nested.names=[q]"])
    data = to_dict(config)
    assert data["inner"]["color"] == "blue"
    assert data["pair"] == [5, 6]
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_yaml(config))
    assert load_config(Outer, path, env={}) == config

    service = load_config(TrainerServiceConfig, env={}, overrides=["server.port=123"])
    assert yaml.safe_load(dump_yaml(service))["server"]["port"] == 123
    assert list(to_dict(service)) == ["server", "trainer"]


def test_example_configs_load() -> None:
    root = Path(__file__).resolve().parents[2] / "examples" / "services"
    for config_type, name in [
        (TrainerServiceConfig, "trainer"),
        (RolloutServiceConfig, "rollout"),
        (WeightSyncServiceConfig, "weightsync"),
    ]:
        config = load_config(config_type, root / f"{name}.yaml", env={})
        assert config.server.port != 0
        assert config.server.metrics_enabled
