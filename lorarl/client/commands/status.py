"""`lorarl status RUN_DIR [--json]`: where the run writing to RUN_DIR (a job's output.dir) stands.

From its files: whether its `lorarl run` is running, the services it started and their addresses, the job's
resume point (step, version, data cursor, checkpoint), its last metrics line. From its services, while they
answer (the run's own token, a short deadline): weight sync's latest and active version of the job and the
replicas serving it, and the trainer's jobs. A service that does not answer is said to, never waited for.

exit status: 0 (whatever the run's state), 2 when RUN_DIR is not a run directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lorarl.client.launch.launcher_record import read_record
from lorarl.client.launch.run_dir import run_dir_problem
from lorarl.client.launch.service_files import probe_all, read_token, recorded_services

DEFAULT_TIMEOUT_S = 3.0
#: The last metrics line's entries shown in text (all of them with --json), these first where present.
METRICS_SHOWN = 6
METRICS_FIRST = ("reward_mean", "accuracy", "loss", "version")
#: Read from the end of metrics.jsonl: far more than a line, far less than a long run's file.
TAIL_BYTES = 1 << 16


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("status", help="where a run stands: services, resume point, last metrics",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the job's output.dir, e.g. runs/demo")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"deadline of each question to a service (default {DEFAULT_TIMEOUT_S:g} s)")
    parser.set_defaults(handler=status_command)


def status_command(args: argparse.Namespace) -> int:
    if problem := run_dir_problem(args.run_dir):
        print(f"lorarl status: {problem}", file=sys.stderr)
        return 2
    report = gather(Path(args.run_dir), args.timeout)
    print(json.dumps(report) if args.json else "\n".join(render(report)))
    return 0


# ------------------------------------------------------------------ what the files say


def gather(run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Everything the status says, as JSON-ready data (the --json output)."""
    from lorarl.client.rl.session import read_point

    settings = _read_json(run_dir / "resume_config.json") or _read_json(run_dir / "config.json") or {}
    job_id = settings.get("job_id")
    services_dir = run_dir / "services"
    processes = recorded_services(services_dir)
    probe_all(processes, timeout_s)
    try:
        point = read_point(run_dir)
    except (OSError, ValueError, KeyError):
        point = None
    token = read_token(services_dir)
    by_service = {p.service: p for p in processes}
    return {
        "run_dir": str(run_dir), "job_id": job_id,
        "model": (settings.get("model") or {}).get("path"), "steps": (settings.get("loop") or {}).get("steps"),
        "launcher": launcher(services_dir),
        "services": [p.as_dict() for p in processes],
        "services_up": bool(processes) and all(p.up for p in processes),
        "resume": None if point is None else {"step": point.step, "version": point.version, "cursor": point.cursor,
                                              "checkpoint": point.checkpoint},
        "metrics": last_metrics(run_dir / "metrics.jsonl"),
        "weightsync": ask(by_service.get("weightsync"), lambda a: sync_status(a, token, job_id, timeout_s)),
        "trainer": ask(by_service.get("trainer"), lambda a: trainer_jobs(a, token, timeout_s)),
    }


def launcher(services_dir: Path) -> dict[str, Any]:
    try:
        record = read_record(services_dir)
    except ValueError as e:
        return {"state": "unreadable", "error": str(e)}
    if record is None:
        return {"state": "none"}
    return {"state": record.liveness(), "pid": record.pid, "started_at": record.started_at,
            "command": record.command, "describe": record.describe()}


def last_metrics(path: Path) -> dict[str, Any] | None:
    """The last whole JSON line of metrics.jsonl (a line being written is not one yet), None when there is none."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            return row
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# ------------------------------------------------------------------ what the services say


def ask(process: Any, question: Any) -> dict[str, Any]:
    """``question(address)`` of a service that answered the health probe; "not answering" otherwise, with why."""
    if process is None:
        return {"answering": False, "error": "none recorded"}
    if not process.up:
        return {"address": process.address, "answering": False,
                "error": "TLS (not asked)" if process.tls else "not serving"}
    import grpc

    try:
        return {"address": process.address, "answering": True, **question(process.address)}
    except grpc.RpcError as e:
        return {"address": process.address, "answering": False, "error": f"{e.code().name}: {e.details()}"}


def sync_status(address: str, token: str | None, job_id: str | None, timeout_s: float) -> dict[str, Any]:
    from lorarl.common.channel import sync_channel
    from lorarl.v1 import weightsync_pb2, weightsync_pb2_grpc

    with sync_channel(address, token=token) as channel:
        reply = weightsync_pb2_grpc.WeightSyncServiceStub(channel).GetSyncStatus(
            weightsync_pb2.GetSyncStatusRequest(), timeout=timeout_s)
    jobs = [{"job_id": j.job_id, "latest_version": j.latest_version, "active_version": j.active_version,
             "replicas": [{"replica_id": r.replica_id, "active_version": r.active_version, "connected": r.connected,
                           "serve_address": r.serve_address} for r in j.replicas]}
            for j in reply.jobs if job_id is None or j.job_id == job_id]
    return {"jobs": jobs, "fleet": [r.replica_id for r in reply.fleet]}


def trainer_jobs(address: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    from lorarl.client.commands.jobs import rows
    from lorarl.common.channel import sync_channel
    from lorarl.v1 import trainer_pb2, trainer_pb2_grpc

    with sync_channel(address, token=token) as channel:
        listed = trainer_pb2_grpc.TrainerServiceStub(channel).ListJobs(trainer_pb2.ListJobsRequest(), timeout=timeout_s)
    return {"jobs": rows(list(listed.jobs))}


# ------------------------------------------------------------------ text


def render(report: dict[str, Any]) -> list[str]:
    job = f"job {report['job_id']}" if report["job_id"] else "job not started yet (no config.json)"
    lines = [("run", f"{report['run_dir']}: {job}" + (f", model {report['model']}" if report["model"] else "")),
             ("launcher", render_launcher(report["launcher"])),
             ("services", render_services(report["services"])),
             ("resume", render_resume(report["resume"], report["steps"])),
             ("metrics", render_metrics(report["metrics"], Path(report["run_dir"]) / "metrics.jsonl")),
             ("weightsync", render_sync(report["weightsync"], report["job_id"])),
             ("trainer", render_trainer(report["trainer"]))]
    return [f"{label:<11}{text}" for label, text in lines]


def render_launcher(found: dict[str, Any]) -> str:
    state = found["state"]
    if state == "running":
        return f"running: {found['describe']}"
    if state == "none":
        return "not running"
    if state == "unreadable":
        return f"unknown: {found['error']}"
    why = "is gone" if state == "gone" else "now names another process"
    return f"not running (stale record: pid {found['pid']} {why})"


def render_services(processes: list[dict[str, Any]]) -> str:
    if not processes:
        return "none recorded (this run has not started services here)"
    where = ", ".join(f"{p['name']} {p['address']}" for p in processes)
    if all(p["up"] for p in processes):
        return f"up: {where}"
    if not any(p["up"] for p in processes):
        return f"not answering (last at {where})"
    return "; ".join(f"{p['name']} {p['address']} " + ("up" if p["up"] else "not answering") for p in processes)


def render_resume(point: dict[str, Any] | None, steps: int | None) -> str:
    if point is None:
        return "none yet (no state.json)"
    total = f" of {steps}" if steps else ""
    return (f"step {point['step']}{total} (version {point['version']}, data cursor {point['cursor']}); checkpoint "
            f"{point['checkpoint']}")


def render_metrics(row: dict[str, Any] | None, path: Path) -> str:
    if row is None:
        return "none yet"
    entries = [(k, v) for k, v in row.items() if k != "step"]
    entries.sort(key=lambda kv: next((i for i, word in enumerate(METRICS_FIRST) if word in kv[0]), len(METRICS_FIRST)))
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entries[:METRICS_SHOWN])
    more = f" (+{len(entries) - METRICS_SHOWN} more in {path})" if len(entries) > METRICS_SHOWN else ""
    return f"step {row.get('step', '?')}: {shown}{more}"


def render_sync(found: dict[str, Any], job_id: str | None) -> str:
    if not found["answering"]:
        return f"not answering ({found['error']})"
    if not found["jobs"]:
        return f"no version of job {job_id} yet (rollout fleet: {', '.join(found['fleet']) or 'none'})"
    parts = []
    for job in found["jobs"]:
        replicas = ", ".join(f"{r['replica_id']} serves {r['active_version']}" for r in job["replicas"]) or "none"
        parts.append(f"{job['job_id']}: latest version {job['latest_version']}, active {job['active_version']} "
                     f"(replicas: {replicas})")
    return "; ".join(parts)


def render_trainer(found: dict[str, Any]) -> str:
    if not found["answering"]:
        return f"not answering ({found['error']})"
    if not found["jobs"]:
        return "no jobs"
    return "; ".join(f"job {j['job']}: step {j['step']}, version {j['version']}, rank {j['rank']}, "
                     f"{j['buffered']} buffered" for j in found["jobs"])
