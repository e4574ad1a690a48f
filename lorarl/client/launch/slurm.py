"""An sbatch script that runs a job on a Slurm allocation: the services with `srun` on its nodes, then the loop.

The same services and configs `lorarl run` starts (lorarl.client.launch.services.stack_sections), placed by
the job's placement plan (lorarl.client.job.plan.place: the trainer's devices on the first node, each rollout
replica's tensor-parallel group on one node): weight sync and the trainer on the first node of the
allocation, one `srun` step per rollout replica on the node the plan gives it, each with its device
mask. Services bind every interface on fixed ports and reach each other by the nodes' host names; the
replicas advertise theirs to weight sync, and the loop (`lorarl train` without --rollout, on the batch
host) learns them there. The run folder must be on a filesystem every node mounts (configs, token,
checkpoints): that is what Slurm clusters have. Untested on a real Slurm cluster (none here): the test
checks every command against the config and runs the script with stand-ins for srun and scontrol.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lorarl.client.job.config import METRICS_PORT_OFFSET
from lorarl.client.launch.local import metrics_url
from lorarl.client.launch.log_files import MIB
from lorarl.client.launch.services import version_teacher_refusal
from lorarl.common.config import ConfigError

WEIGHTSYNC_PORT, TRAINER_PORT, ROLLOUT_PORT = 50053, 50051, 50052
#: The device mask variable per trainer.device kind.
MASK = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
READY_TIMEOUT_S = 900
TRAINER_RENDEZVOUS_PORT = 29500


@dataclass(frozen=True)
class Task:
    """One `srun` step: a service on one node of the allocation (the trainer: on ``nodes`` nodes from ``node``,
    one torchrun agent each, when its ranks span several)."""

    name: str
    service: str
    node: int
    port: int
    devices: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    nodes: int = 1


def tasks(cfg) -> list[Task]:
    """Weight sync and the trainer on node 0, rollout replicas where the placement plan puts them (CPU jobs:
    round-robin over the other nodes, or node 0 alone), ports counting up per node."""
    from lorarl.client.job.plan import Slot, place

    nodes = cfg.placement.nodes
    if cfg.placement.devices_per_node:
        try:
            slots = place(cfg)
        except ValueError as e:
            raise ConfigError("placement", str(e)) from None
    else:
        slots = [Slot("trainer", 0, ()), *(Slot(f"rollout-{i}", 1 + i % (nodes - 1) if nodes > 1 else 0, ())
                                          for i in range(cfg.rollout.replicas))]
    trainer = [s for s in slots if s.role == "trainer"]
    if len(trainer) > 1 and any(len(s.devices) != len(trainer[0].devices) for s in trainer):
        raise ConfigError("trainer.parallel", f"{cfg.trainer.parallel.world_size} trainer ranks across nodes of "
                                              f"{cfg.placement.devices_per_node} devices: torchrun needs the same "
                                              "number of ranks on every node")
    out = [Task("weightsync", "weightsync", 0, WEIGHTSYNC_PORT, ()),
           Task("trainer", "trainer", 0, TRAINER_PORT, trainer[0].devices, nodes=len(trainer))]
    per_node: dict[int, int] = {}
    for slot in slots:
        if slot.role == "trainer":
            continue
        port = ROLLOUT_PORT + 10 * per_node.get(slot.node, 0)  # apart from the trainer's and weight sync's
        per_node[slot.node] = per_node.get(slot.node, 0) + 1
        out.append(Task(slot.role, "rollout", slot.node, port, slot.devices,
                        (f"rollout.replica_id={slot.role}", f"server.port={port}")))
    return out


def trainer_nodes(cfg) -> int:
    return next(t.nodes for t in tasks(cfg) if t.service == "trainer")


def service_configs(cfg, run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each service's config file: stack_sections' settings, bound to every interface on a fixed port, the
    run's token file, addresses by node host name filled in by the script (environment variables)."""
    from lorarl.client.launch.services import stack_sections

    sections = stack_sections(cfg, run_dir)
    sections["weightsync"]["storage_dir"] = str(run_dir / "weightsync")
    if trainer_nodes(cfg) > 1:  # torchrun starts the ranks on every node: the trainer starts none itself
        sections["trainer"].pop("ranks", None)
    sections["rollout"].pop("replica_id", None)
    token = str(run_dir / "services" / "token")
    configs = {}
    metrics = cfg.output.prometheus
    for service, port in (("weightsync", WEIGHTSYNC_PORT), ("trainer", TRAINER_PORT), ("rollout", ROLLOUT_PORT)):
        configs[service] = {
            "server": {"host": "0.0.0.0", "port": port, "metrics_port": port + METRICS_PORT_OFFSET if metrics else -1,
                       **({"metrics_host": cfg.output.prometheus_host} if metrics else {}), "log_format": "text",
                       "shutdown_grace_s": 10, "auth": {"token_file": token, "token_env": None, "required": True}},
            service: sections[service]}
    return configs


def metrics_overrides(cfg, task: Task) -> list[str]:
    """output.prometheus: the task's metrics port (its gRPC port + METRICS_PORT_OFFSET, fixed as the gRPC ports are,
    so a scrape config can name it up front) and its ready file beside its log, which says the port too."""
    if not cfg.output.prometheus:
        return []
    return [f"server.metrics_port={task.port + METRICS_PORT_OFFSET}",
            f"server.ready_file=$RUN/services/{task.name}.ready.json"]


def metrics_echo(cfg, steps: list[Task]) -> list[str]:
    """output.prometheus: the script's line naming every service's metrics endpoint once all are up."""
    if not cfg.output.prometheus:
        return []
    host = cfg.output.prometheus_host
    where = []
    for task in steps:
        node = f"${{NODES[{task.node}]}}"
        url = metrics_url(host, node, task.port + METRICS_PORT_OFFSET)
        where.append(f"{task.name} {url}" + ("" if node in url else f" on {node}"))
    return [f'echo "lorarl: Prometheus metrics at {", ".join(where)}"']


def sbatch_script(cfg, config_path: str, overrides: list[str], run_dir: Path, partition: str = "",
                  time_limit: str = "") -> tuple[str, dict[str, dict[str, Any]]]:
    """(the script, the service configs it reads from <run>/slurm/SERVICE.yaml)."""
    steps = tasks(cfg)
    device = cfg.trainer.device.split(":", 1)[0]
    mask = MASK.get(device)
    per_node = cfg.placement.devices_per_node
    lines = [
        "#!/bin/bash",
        f"# Written by `lorarl slurm {shlex.join([config_path, *overrides])}`: the job on a Slurm allocation",
        "# (lorarl/client/launch/slurm.py). Submit it with sbatch; the run folder must be on a shared filesystem.",
        f"#SBATCH --job-name=lorarl-{cfg.job_id}",
        f"#SBATCH --nodes={cfg.placement.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        *([f"#SBATCH --gpus-per-node={per_node}"] if device == "cuda" and per_node else []),
        *([f"#SBATCH --partition={partition}"] if partition else []),
        *([f"#SBATCH --time={time_limit}"] if time_limit else []),
        "set -euo pipefail",
        f"RUN={shlex.quote(str(run_dir))}",
        'mkdir -p "$RUN/services"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'if [ "${{#NODES[@]}}" -lt {cfg.placement.nodes} ]; then',
        f'  echo "lorarl: the allocation has ${{#NODES[@]}} nodes; the job places services on '
        f'{cfg.placement.nodes}" >&2',
        "  exit 2",
        "fi",
        "# The bearer token every service and the loop read, readable by this user only.",
        '(umask 077; python3 -c "import secrets; print(secrets.token_hex(16))" > "$RUN/services/token")',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false",
        "export VLLM_ENABLE_V1_MULTIPROCESSING=0",
        f"export LORARL_TRAINER__WEIGHTSYNC_ADDRESS=\"${{NODES[0]}}:{WEIGHTSYNC_PORT}\"",
        f"export LORARL_ROLLOUT__WEIGHTSYNC_ADDRESS=\"${{NODES[0]}}:{WEIGHTSYNC_PORT}\"",
        'export LORARL_TRAINER__SENDER_HOST="${NODES[0]}"',
        "PIDS=()",
        "stop() { kill -TERM \"${PIDS[@]}\" 2>/dev/null || true; wait || true; }",
        "trap stop EXIT",
        "ready() {  # HOST:PORT NAME: until its gRPC health check answers SERVING",
        f"  local deadline=$((SECONDS + {READY_TIMEOUT_S}))",
        "  until python3 -m lorarl.common.health_probe \"$1\" >/dev/null 2>&1; do",
        "    if [ $SECONDS -ge $deadline ]; then echo \"lorarl: $2 at $1 did not start; see $RUN/services/$2.log\" >&2;"
        " exit 1; fi",
        "    sleep 2",
        "  done",
        "}",
    ]
    if cfg.output.service_log_mib > 0:  # each service log under output.service_log_mib, as `lorarl run` keeps it
        lines += [" ".join(["python3", "-m", "lorarl.client.launch.log_files", '"$RUN/services"',
                            f"--max-bytes={int(cfg.output.service_log_mib * MIB)}",
                            f"--backups={cfg.output.service_log_backups}", "&"]), "PIDS+=($!)"]
    for group in (steps[:1], steps[1:2], steps[2:]):  # weight sync, then the trainer, then every replica at once
        for task in group:
            env = [f"{mask}={','.join(map(str, task.devices))}"] if mask and task.devices else []
            if task.service == "rollout":
                env.append(f"LORARL_ROLLOUT__ADVERTISE_ADDRESS=${{NODES[{task.node}]}}")
                env.append(f"LORARL_ROLLOUT__SYNC_HOST=${{NODES[{task.node}]}}")
            serve = ["lorarl", "serve", task.service, "--config", f"$RUN/slurm/{task.service}.yaml", *task.overrides,
                     *metrics_overrides(cfg, task)]
            if task.nodes > 1:  # one torchrun agent per node; rank 0 (node 0) serves gRPC
                nodelist = ",".join(f"${{NODES[{task.node + i}]}}" for i in range(task.nodes))
                torchrun = ["torchrun", f"--nnodes={task.nodes}", f"--nproc-per-node={len(task.devices)}",
                            f"--master-addr=${{NODES[{task.node}]}}", f"--master-port={TRAINER_RENDEZVOUS_PORT}",
                            "-m", "lorarl.client.cli", *serve[1:]]
                # The task's own shell reads its node's rank (\$SLURM_NODEID); the batch script fills in the rest.
                inner = " ".join(["exec", "env", *env, *(_quote(c) for c in torchrun)]).replace('"', '\\"')
                inner = inner.replace("--nnodes=", "--node-rank=\\$SLURM_NODEID --nnodes=", 1)
                command = ["srun", "--overlap", f"--nodes={task.nodes}", f"--ntasks={task.nodes}",
                           "--ntasks-per-node=1", f"--nodelist={nodelist}", "bash", "-c", inner]
            else:
                command = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist=${{NODES[{task.node}]}}",
                           *(["env", *env] if env else []), *serve]
            # appended (>>): the rotator below copies and truncates a full log, and the next line lands at its start
            lines.append(" ".join(_quote(c) for c in command) + f' >> "$RUN/services/{task.name}.log" 2>&1 &')
            lines.append("PIDS+=($!)")
        for task in group:
            lines.append(f'ready "${{NODES[{task.node}]}}:{task.port}" {task.name}')
    lines += metrics_echo(cfg, steps)
    lines += [
        "# The loop, on the batch host: it learns the rollout replicas from weight sync.",
        " ".join(["lorarl", "train", _quote(config_path),
                  *(_quote(o) for o in overrides if not o.startswith("output.dir=")),
                  f"output.dir={_quote(str(run_dir))}", "--trainer", f'"${{NODES[0]}}:{TRAINER_PORT}"',
                  "--weightsync", f'"${{NODES[0]}}:{WEIGHTSYNC_PORT}"', "--token-file", '"$RUN/services/token"']),
    ]
    return "\n".join(lines) + "\n", service_configs(cfg, run_dir)


def _quote(word: str) -> str:
    """shlex.quote, but a word that refers to script variables ($RUN, ${NODES[i]}) stays expandable."""
    if "$" in word:
        return f'"{word}"'
    return shlex.quote(word)


def write(cfg, config_path: str, overrides: list[str], script: Path, **kwargs: str) -> list[Path]:
    if key := cfg.model_teacher_key():
        raise ConfigError(key, "the Slurm script does not start a full-model teacher's engine (not built): make the "
                               "teacher an adapter of the job's base, or run the job with `lorarl run` on one host")
    if key := cfg.version_teacher_key():
        raise ConfigError(key, version_teacher_refusal(cfg))
    run_dir = Path(cfg.output.dir).resolve()
    text, configs = sbatch_script(cfg, str(Path(config_path).resolve()), overrides, run_dir, **kwargs)
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for service, config in configs.items():
        path = folder / f"{service}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        written.append(path)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    script.chmod(0o755)
    return [script, *written]
