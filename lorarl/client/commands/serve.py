"""`lorarl serve <service>`: load a service config and run the service until SIGTERM/SIGINT.

Precedence, lowest to highest: config defaults, --config FILE, LORARL_<SECTION>__<KEY>
environment variables, --set key.sub=value, then the dedicated flags (--host, --port, ...).
Exit codes: 0 after a graceful shutdown, 2 for a configuration error, 1 if the server cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import sys
from types import ModuleType
from typing import Any

from lorarl.common.config import ConfigError, dump_yaml, load_config
from lorarl.common.cpu_affinity import parse_cpu_list, pin_process, thread_ids
from lorarl.common.log import configure_logging

#: Service -> module exposing CONFIG_TYPE (a config dataclass) and `async serve_forever(config)`.
SERVICES = {
    "trainer": "lorarl.trainer.service.server",
    "rollout": "lorarl.rollout.server",
    "weightsync": "lorarl.weightsync.service.server",
    "tinker": "lorarl.tinker.server",
}

#: How long a service whose launcher died has to stop as on SIGTERM before it exits regardless: the launcher's
#: services must be gone within seconds of it (a launcher's stop gives them server.shutdown_grace_s, 5 s).
ORPHAN_GRACE_S = 8.0

#: Flag destination -> dotted config key it overrides.
FLAG_KEYS = {
    "host": "server.host",
    "port": "server.port",
    "metrics_port": "server.metrics_port",
    "ready_file": "server.ready_file",
    "log_level": "server.log_level",
    "log_format": "server.log_format",
}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run a service (trainer, rollout, weightsync, tinker)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("service", choices=sorted(SERVICES), help="which service to run")
    parser.add_argument("--config", metavar="FILE", help="YAML config file")
    parser.add_argument("--host", help="address to bind (server.host)")
    parser.add_argument("--port", type=int, help="gRPC port, 0 for any free port (server.port)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port, 0 any, -1 off (server.metrics_port)")
    parser.add_argument("--ready-file", metavar="FILE", help="write the listening ports here (server.ready_file)")
    parser.add_argument("--log-level", help="debug, info, warning, error (server.log_level)")
    parser.add_argument("--log-format", help="json or text (server.log_format)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set server.shutdown_grace_s=5 (repeatable)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    parser.set_defaults(handler=run)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """`key=value` overrides for the dedicated flags that were given."""
    return [f"{key}={getattr(args, dest)}" for dest, key in FLAG_KEYS.items() if getattr(args, dest) is not None]


def lower_priority(nice: int) -> None:
    """Adds ``nice`` to the process before the service starts its threads, which inherit it. On Linux
    niceness is per thread, so threads that libraries started at import are set one by one too."""
    os.nice(nice)
    target = os.getpriority(os.PRIO_PROCESS, 0)
    for tid in thread_ids():
        with contextlib.suppress(OSError):  # a thread that has just exited
            os.setpriority(os.PRIO_PROCESS, tid, target)


def run(args: argparse.Namespace) -> int:
    from lorarl.common.parent_watch import watch_if_marked
    from lorarl.common.server import ServiceDiedError, StartupError

    # Started by a launcher (lorarl.client.launch.local) or a Ray actor (ray_host): gone with it, even by SIGKILL,
    # stopping as on SIGTERM (its engine core and files released) within ORPHAN_GRACE_S.
    watch_if_marked(grace_s=ORPHAN_GRACE_S)

    module: ModuleType = importlib.import_module(SERVICES[args.service])
    prefix = f"lorarl serve {args.service}"
    try:
        config = load_config(module.CONFIG_TYPE, args.config, overrides=[*args.overrides, *flag_overrides(args)])
    except ConfigError as exc:
        print(f"{prefix}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_yaml(config), end="")
        return 0
    # Logging from the start: what start-up reports (the engine, its CPUs) comes before the server runs.
    configure_logging(args.service, level=config.server.log_level, fmt=config.server.log_format)
    if config.server.cpu_nice:
        lower_priority(config.server.cpu_nice)
    if config.server.cpus:
        try:
            pin_process(parse_cpu_list(config.server.cpus))
        except ValueError as exc:
            print(f"{prefix}: invalid configuration: server.cpus: {exc}", file=sys.stderr)
            return 2
    try:
        asyncio.run(module.serve_forever(config))
    except ConfigError as exc:
        print(f"{prefix}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 1
    except ServiceDiedError as exc:
        print(f"{prefix}: stopped: {exc}; restart the service", file=sys.stderr)
        return 1
    return 0
