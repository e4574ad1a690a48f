"""`lorarl slurm`: the sbatch script's commands match the job (ports, devices per task, addresses), and the
script runs the job: with stand-ins for `srun` (runs the step on "its node", a loopback address of its own)
and `scontrol` (the allocation's host names), the services start, the loop learns the replicas from weight
sync and finishes, and everything stops with the script."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lorarl.client.job.config import load_job_config
from lorarl.client.job.plan import place
from lorarl.client.launch.slurm import ROLLOUT_PORT, TRAINER_PORT, WEIGHTSYNC_PORT
from lorarl.common.config import load_config
from lorarl.rollout.config import RolloutServiceConfig
from lorarl.trainer.service.config import TrainerServiceConfig
from lorarl.weightsync.service.config import WeightSyncServiceConfig

ROOT = Path(__file__).resolve().parents[3]
LORARL = str(Path(sys.executable).with_name("lorarl"))
CONFIG_TYPES = {"weightsync": WeightSyncServiceConfig, "trainer": TrainerServiceConfig,
                "rollout": RolloutServiceConfig}


def generate(tmp_path: Path, *overrides: str, config: str = "examples/demo.yaml") -> tuple[str, Path]:
    out = tmp_path / "run"
    result = subprocess.run([LORARL, "slurm", config, *overrides, f"output.dir={out}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return (out / "lorarl.sbatch").read_text(), out


def steps(script: str) -> dict[str, dict]:
    """Each srun step: its node index, device mask, service, config overrides."""
    found = {}
    for line in script.splitlines():
        if not line.startswith("srun ") or "torchrun" in line:  # a trainer across nodes: its own test
            continue
        words = shlex.split(line.split(" >> ")[0].replace("${NODES[", "NODE").replace("]}", ""))
        node = int(next(w for w in words if w.startswith("--nodelist=")).removeprefix("--nodelist=NODE"))
        env = dict(w.split("=", 1) for w in words[words.index("env") + 1:words.index("lorarl")]) \
            if "env" in words else {}
        serve = words[words.index("lorarl"):]
        overrides = dict(w.split("=", 1) for w in serve[5:])
        name = overrides.get("rollout.replica_id", serve[2])
        found[name] = {"node": node, "env": env, "service": serve[2], "config": serve[4], "overrides": overrides}
    return found


def test_commands_match_the_config(tmp_path: Path) -> None:
    config = "examples/npu/qwen3-30b-a3b-merged.yaml"
    cfg = load_job_config(config, [])
    script, out = generate(tmp_path, config=config)
    found = steps(script)
    assert "#SBATCH --nodes=1" in script
    slots = {s.role: s for s in place(cfg)}
    assert set(found) == {"weightsync", "trainer", *(f"rollout-{i}" for i in range(cfg.rollout.replicas))}
    for role, slot in slots.items():  # devices per task: the placement plan's, as the device mask
        assert found[role]["env"]["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, slot.devices))
        assert found[role]["node"] == slot.node
    (out / "services").mkdir(exist_ok=True)
    (out / "services" / "token").write_text("t")
    ports = {}
    rollout_file = yaml.safe_load((out / "slurm" / "rollout.yaml").read_text())["rollout"]
    assert rollout_file["model_path"] == str((ROOT / cfg.model.path).resolve())  # the job's model (absent here)
    for name, step in found.items():
        path = step["config"].replace("$RUN", str(out))
        here = [f"rollout.model_path={ROOT / 'lorarl/assets/models/qwen3-tiny'}"] if step["service"] == "rollout" \
            else []
        overrides = [f"{k}={v}" for k, v in step["overrides"].items()] + here
        loaded = load_config(CONFIG_TYPES[step["service"]], path, overrides=overrides, env={})
        assert loaded.server.auth.token_file == str(out / "services" / "token")
        assert loaded.server.host == "0.0.0.0"
        ports[name] = loaded.server.port
        if step["service"] == "rollout":
            assert step["env"]["LORARL_ROLLOUT__ADVERTISE_ADDRESS"] == f"NODE{step['node']}"  # its node's name
    assert ports["weightsync"] == WEIGHTSYNC_PORT and ports["trainer"] == TRAINER_PORT
    per_node = [(found[n]["node"], p) for n, p in ports.items()]
    assert len(per_node) == len(set(per_node))  # no two services of one node on one port
    assert ports["rollout-0"] == ROLLOUT_PORT
    # The addresses: every service and the loop reach weight sync and the trainer where they listen.
    assert f'LORARL_ROLLOUT__WEIGHTSYNC_ADDRESS="${{NODES[0]}}:{ports["weightsync"]}"' in script
    assert f'LORARL_TRAINER__WEIGHTSYNC_ADDRESS="${{NODES[0]}}:{ports["weightsync"]}"' in script
    train = next(line for line in script.splitlines() if line.startswith("lorarl train"))
    assert f'--trainer "${{NODES[0]}}:{ports["trainer"]}"' in train and "--rollout" not in train
    for name, step in found.items():
        assert f'ready "${{NODES[{step["node"]}]}}:{ports[name]}" {name}' in script
    assert f'python3 -m lorarl.client.launch.log_files "$RUN/services" --max-bytes={64 << 20} --backups=2 &' \
        in script  # the service logs under output.service_log_mib, as `lorarl run` keeps them
    subprocess.run(["bash", "-n", str(out / "lorarl.sbatch")], check=True)


def test_bad_placement_is_refused_naming_it(tmp_path: Path) -> None:
    result = subprocess.run([LORARL, "slurm", "examples/npu/qwen3-30b-a3b-merged.yaml", "rollout.replicas=9",
                             f"output.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "placement" in result.stderr


STAND_INS = {
    "srun": """#!/bin/bash
# srun stand-in: runs the step on "its node", the loopback address --nodelist names, as srun runs it there.
node=""
while [[ $1 == --* ]]; do case $1 in --nodelist=*) node=${1#--nodelist=};; esac; shift; done
export LORARL_SERVER__HOST=$node
exec "$@"
""",
    "scontrol": """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf '127.0.0.1\\n127.0.0.2\\n127.0.0.3\\n'
""",
}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_the_script_runs_the_job(tmp_path: Path) -> None:
    cap = 8 << 10
    _, out = generate(tmp_path, "placement.nodes=3", "rollout.replicas=2", "loop.steps=4", "loop.eval_every=0",
                      "data.eval_size=16", "output.progress=false", "output.tensorboard=false",
                      f"output.service_log_mib={cap / (1 << 20)}", "output.service_log_backups=50")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "node[1-3]"}
    result = subprocess.run(["bash", str(out / "lorarl.sbatch")], cwd=ROOT, capture_output=True, text=True,
                            env=env, timeout=800)
    logs = {p.name: "".join(c.read_text() for c in with_copies(p)) for p in (out / "services").glob("*.log")}
    assert result.returncode == 0, (result.stderr[-3000:], {k: v[-1500:] for k, v in logs.items()})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(int(r.get("step", 0)) for r in rows) == 4
    # The loop found both replicas through weight sync, each at its node's address.
    assert "rollout replicas (from weight sync): rollout-0 at 127.0.0.2:50052, rollout-1 at 127.0.0.3:50052" \
        in result.stdout, result.stdout[-3000:]
    for name in ("weightsync", "trainer", "rollout-0", "rollout-1"):  # each stopped cleanly with the script
        assert "received SIGTERM" in logs[f"{name}.log"] and "lorarl.common.server: stopped" in logs[f"{name}.log"]
    assert yaml.safe_load((out / "slurm" / "rollout.yaml").read_text())["server"]["port"] == ROLLOUT_PORT
    # a rollout's vLLM start alone passes the 8 KiB cap: its log was rotated, with no hole where the service
    # went on writing after a truncate (its output is appended)
    rollout = with_copies(out / "services" / "rollout-0.log")
    assert len(rollout) > 1, "the rollout's log was never rotated"
    assert all(b"\0" not in path.read_bytes() for path in rollout)


def with_copies(log: Path) -> list[Path]:
    """A log's rotated copies, oldest first, then the log."""
    copies = [c for c in log.parent.glob(f"{log.name}.*") if c.suffix[1:].isdigit()]
    return [*sorted(copies, key=lambda c: -int(c.suffix[1:])), log]


def test_a_trainer_across_nodes_is_one_torchrun_agent_per_node(tmp_path: Path) -> None:
    config = "examples/models/qwen3.6-27b-multinode.yaml"
    script, out = generate(tmp_path, config=config)
    (line,) = [s for s in script.splitlines() if s.startswith("srun") and "serve trainer" in s]
    assert '--nodes=2 --ntasks=2 --ntasks-per-node=1 "--nodelist=${NODES[0]},${NODES[1]}"' in line
    # The node rank is read by each task's own shell; the rendezvous is rank 0's node.
    assert "torchrun --node-rank=\\$SLURM_NODEID --nnodes=2 --nproc-per-node=8" in line
    assert '\\"--master-addr=${NODES[0]}\\"' in line and "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in line
    assert "ranks" not in yaml.safe_load((out / "slurm" / "trainer.yaml").read_text())["trainer"]
    rollouts = steps(script)
    assert sorted({s["node"] for n, s in rollouts.items() if n.startswith("rollout-")}) == [2, 3]
    assert "#SBATCH --gpus-per-node=8" in script
    subprocess.run(["bash", "-n", str(out / "lorarl.sbatch")], check=True)
