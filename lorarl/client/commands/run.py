"""`lorarl run CONFIG [key=value ...]` and `lorarl train CONFIG --trainer A --rollout A --weightsync A`.

run:   starts the three services on loopback (own processes, free ports, a generated token), runs
       the job, and stops them on success, failure or Ctrl-C; resumes from the run directory's last
       checkpoint when one exists.
train: the same loop against services already running (compose stack, other hosts); the token
       comes from --token-file (or $LORARL_AUTH_TOKEN_FILE), else $LORARL_AUTH_TOKEN.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorarl.client.calls import ServiceCallError, client_token
from lorarl.client.job_config import serving_length
from lorarl.client.recovery import ActivationFailedError, RecoveryExhaustedError
from lorarl.client.stack import ServiceFailedError
from lorarl.common.channel import ClientTls
from lorarl.common.config import ConfigError, to_dict
from lorarl.contract import staleness

#: What ends a run with a one-line message instead of a traceback (anything else is a bug: traceback).
RUN_ENDING_ERRORS = (ServiceCallError, RecoveryExhaustedError, ActivationFailedError, RuntimeError, ServiceFailedError)


def add_parsers(subparsers: Any) -> None:
    run = subparsers.add_parser("run", help="start the services on loopback and run a job", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(run)
    run.set_defaults(handler=run_command)
    train = subparsers.add_parser("train", help="run a job against services already running", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(train)
    train.add_argument("--trainer", required=True, metavar="HOST:PORT")
    train.add_argument("--rollout", metavar="HOST:PORT[,HOST:PORT...]",
                       help="a static list of rollout replicas (comma-separated); prompts are split across them. "
                       "Without it the loop learns the replicas from weight sync: those that join mid-run are used, "
                       "those that leave are dropped")
    train.add_argument("--weightsync", required=True, metavar="HOST:PORT",
                       help="the weight-sync service the trainer and rollouts use (checked for reachability)")
    train.add_argument("--openai", metavar="URL[,URL...]", help="each rollout replica's OpenAI-compatible endpoint "
                       "(http://HOST:PORT/v1; rollout.openai_port), for workflows whose agents use it")
    add_token_file(train)
    train.set_defaults(handler=train_command)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="job YAML file (see examples/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. loop.steps=10")
    parser.add_argument("--dry-run", action="store_true", help="validate the config, print the plan, and exit")
    parser.add_argument("--fresh", action="store_true",
                        help="start the job over: ignore the output dir's resume point (train: delete the job)")


def add_token_file(parser: argparse.ArgumentParser) -> None:
    """How a client reaches services elsewhere: the token, and TLS (mutual with a certificate)."""
    parser.add_argument("--token-file", metavar="FILE", help="file holding the services' bearer token (default: "
                        "$LORARL_AUTH_TOKEN_FILE, else the token in $LORARL_AUTH_TOKEN)")
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM CA the services' certificates chain to: use TLS")
    parser.add_argument("--tls-cert", metavar="FILE", help="PEM client certificate, for mutual TLS (with --tls-key)")
    parser.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", metavar="NAME", help="name expected in the services' certificates, "
                        "if not the host of each address")


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS of --tls-* (None: plaintext); ConfigError naming the flag when they do not fit together."""
    for flag in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"--{flag.replace('_', '-')}", f"{path!r} is not a file")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert", "--tls-cert and --tls-key go together")
    if args.tls_ca is None:
        if args.tls_cert is not None or args.tls_server_name is not None:
            raise ConfigError("--tls-ca", "the other --tls-* flags need --tls-ca")
        return None
    return ClientTls(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
                     server_name=args.tls_server_name)


def load(args: argparse.Namespace):
    from lorarl.client.job_config import load_job_config

    try:
        return load_job_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return None


def rollout_lora(cfg) -> bool | None:
    """rollout.enable_lora for this job's rollouts: the job file's, else off in a merged job (its rollouts
    serve merged weights only: no LoRA layers to hold, and on NPUs no MoE-LoRA limits), else the engine's
    own default (None: on where the model can run LoRA)."""
    if cfg.rollout.enable_lora is not None:
        return cfg.rollout.enable_lora
    return False if cfg.sync.mode == "merged" else None


def stack_sections(cfg, out: Path) -> dict[str, dict[str, Any]]:
    """Service config sections for a local stack serving this job."""
    window = staleness.adapter_window(cfg.loop.max_staleness)
    # Weights move over the accelerator's own collective when there is one (untested here: CPU only).
    backend = {"cuda": "nccl", "npu": "hccl"}.get(cfg.trainer.device.split(":", 1)[0], "gloo")
    return {
        "weightsync": {"storage_dir": str(out / "weightsync" / f"launch-{int(time.time())}"),
                       "collective_backend": backend},
        # A CPU trainer shares the cores with generation: its engine threads at niceness 10 do not preempt
        # the rollout engine's step loop, while its gRPC threads keep their normal priority.
        "trainer": {"device": cfg.trainer.device, "checkpoint_dir": str(out / "checkpoints"),
                    **({"compute_nice": 10} if cfg.trainer.device == "cpu" else {}),
                    "export_dir": str(out / "exports"), "collective": cfg.sync.collective,
                    # one process per rank (rank 0 serves gRPC); a torch layer split is one process
                    **({"ranks": ranks} if (ranks := cfg.trainer.parallel.ranks(cfg.trainer.engine)) > 1 else {})},
        "rollout": {"model_path": str(Path(cfg.model.path).resolve()), "engine": cfg.rollout.engine,
                    "dtype": cfg.model.dtype,
                    "kv_cache_gib": cfg.rollout.kv_cache_gib, "max_lora_rank": cfg.serving_lora_rank,
                    "max_loras": window + 1, "adapter_window": window, "replica_id": "rollout-0",
                    "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
                    **({"openai_port": 0} if cfg.rollout.openai else {}),
                    **({"block_size": cfg.rollout.block_size} if cfg.rollout.block_size else {}),
                    **({"max_model_len": length} if (length := serving_length(cfg)) else {}),
                    **{key: getattr(cfg.rollout, key) for key in ("enforce_eager", "gpu_memory_utilization")
                       if getattr(cfg.rollout, key) is not None},
                    **({"enable_lora": lora} if (lora := rollout_lora(cfg)) is not None else {}),
                    "receive_in_worker": cfg.rollout.receive_in_worker,
                    # A step's whole batch (prompts x group) in one decode wave on every replica.
                    "max_num_seqs": cfg.rollout.max_num_seqs or max(64, -(-cfg.loop.prompts_per_step
                                                                      * cfg.rollout.group_size
                                                                      // cfg.rollout.replicas)),
                    "collective_backends": sorted({backend, "gloo"})},
    }


def cpu_pins(cfg) -> dict[str, str]:
    """CPU lists for a CPU job's two busiest processes (placement.pin_cpus 'auto'). An async loop
    generates while it trains: vLLM's engine core on the first half of the CPUs this process may use,
    the trainer on the rest. A sync loop takes turns (generate, then train), so each takes every CPU
    while the other waits: at the Qwen3-0.6B shape on 2 cores a step fell from 36 s to 31 s (generation
    19 -> 13 s; bench/RESULTS.md). The rollout frontend, weight sync and the loop stay where the OS puts
    them. Empty when off, on accelerators, with several rollout replicas, tensor-parallel rollout workers (each
    is bound to CPUs of its own: lorarl/rollout/vllm/cpu_binding.py) or trainer ranks, or on one CPU."""
    from lorarl.common.cpu_affinity import available_cpus, format_cpu_list

    cpus = available_cpus()
    if (cfg.placement.pin_cpus != "auto" or cfg.trainer.device != "cpu" or cfg.rollout.engine != "vllm"
            or cfg.rollout.replicas > 1 or cfg.rollout.tensor_parallel_size > 1
            or cfg.trainer.parallel.world_size > 1 or len(cpus) < 2):
        return {}
    if cfg.loop.mode == "sync":
        return {"rollout_engine": format_cpu_list(cpus), "trainer": format_cpu_list(cpus)}
    half = len(cpus) // 2
    return {"rollout_engine": format_cpu_list(cpus[:half]), "trainer": format_cpu_list(cpus[half:])}


def pinned_threads(pins: dict[str, str]) -> dict[str, dict[str, str]]:
    """OpenMP threads of the pinned processes: one per CPU each is pinned to (the other services keep one:
    two threads per process on two cores made a step 20x slower while all three computed at once).
    Several threads wait passively: threads spinning between ops took the CPUs from the other services'
    Python threads, and a sync demo job (8 steps) took 54 s instead of 34; passive, 32 s."""
    from lorarl.common.cpu_affinity import parse_cpu_list

    env = {}
    for process, key in (("trainer", "trainer"), ("rollout", "rollout_engine")):
        if key in pins:
            threads = len(parse_cpu_list(pins[key]))
            env[process] = {"OMP_NUM_THREADS": str(threads), **({"OMP_WAIT_POLICY": "PASSIVE"} if threads > 1 else {})}
    return env


def local_stack(cfg, out: Path):
    """The services `lorarl run` starts for this job, not yet started (benchmarks start the same)."""
    from lorarl.client.stack import LocalStack

    sections = stack_sections(cfg, out)
    pins = cpu_pins(cfg)
    if pins:
        sections["rollout"]["engine_cpus"] = pins["rollout_engine"]
    threads = 1 if cfg.trainer.device == "cpu" else max(1, (os.cpu_count() or 2) // 3)
    return LocalStack(out / "services", sections, threads_per_service=threads, rollout_replicas=cfg.rollout.replicas,
                      process_env={**visible_devices(cfg), **pinned_threads(pins)},
                      server_sections={"trainer": {"cpus": pins["trainer"]}} if pins else {})


def launch_stack(cfg, out: Path):
    """The services of this job, not yet started: on this host, or placed on a Ray cluster (launcher.kind)."""
    if cfg.launcher.kind == "ray":
        from lorarl.client.ray_stack import RayStack

        out = out.resolve()  # the actors' working folders are not this process's
        threads = 1 if cfg.trainer.device == "cpu" else max(1, int(cfg.launcher.cpus_per_service))
        return RayStack(cfg, out, stack_sections(cfg, out), threads_per_service=threads)
    return local_stack(cfg, out)


def stop_on_sigterm() -> None:
    """SIGTERM (scancel, kubectl delete, a supervisor) stops the run as Ctrl-C does: services stopped, resumable."""
    import signal

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def inputs_ok(cfg) -> bool:
    """The job's data, reward, workflow and warm-start adapter, checked before any service starts."""
    from lorarl.client.job_inputs import check_inputs

    try:
        check_inputs(cfg)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return False
    return True


def dry_run(cfg) -> int:
    """--dry-run: the memory and placement plan, then the job's own inputs (a few rows of its data, its
    reward, its workflow); "config OK" only when both hold."""
    from lorarl.client.job_inputs import check_inputs
    from lorarl.client.plan import print_plan

    code = print_plan(cfg)
    if code:
        return code
    try:
        lines = check_inputs(cfg)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}")
        return 2
    for line in lines:
        print(line)
    print("config OK")
    return 0


def run_command(args: argparse.Namespace) -> int:
    cfg = load(args)
    if cfg is None:
        return 2
    if args.dry_run:
        return dry_run(cfg)
    if cfg.placement.nodes > 1 and cfg.launcher.kind == "local":
        print("lorarl: bad config: placement.nodes: `lorarl run` starts every service on this host; for several "
              "nodes use launcher.kind=ray, or deploy/k8s or deploy/slurm (see examples/models/README.md)",
              file=sys.stderr)
        return 2
    if not inputs_ok(cfg):
        return 2
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    stack = launch_stack(cfg, out)
    stop_on_sigterm()
    # The loop renders prompts with the model's tokenizer: import transformers while the services start.
    threading.Thread(target=importlib.import_module, args=("transformers",), daemon=True).start()
    try:
        with stack:
            rollouts = stack.addresses("rollout")
            print(f"lorarl: services up (trainer {stack.address('trainer')}, rollout {', '.join(rollouts)}, "
                  f"weightsync {stack.address('weightsync')}); logs in {out / 'services'}", flush=True)
            stack.supervise(cfg.recovery.restarts if cfg.recovery.enabled else 0)
            return asyncio.run(drive(cfg, stack.address("trainer"), None, stack.token, out,
                                     stack.address("weightsync"), fresh=args.fresh, give_up=stack.raise_if_failed,
                                     openai_urls=stack.openai_urls))
    except KeyboardInterrupt:
        print("lorarl: interrupted; services stopped. Run the same command again to resume.", file=sys.stderr)
        return 130
    except ConfigError as e:  # the launcher's: no Ray, no cluster at the address, not enough of it
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return 2
    except RUN_ENDING_ERRORS as e:
        return report(e, out, stack)


def train_command(args: argparse.Namespace) -> int:
    cfg = load(args)
    if cfg is None:
        return 2
    if args.dry_run:
        return dry_run(cfg)
    try:
        token = client_token(args.token_file)
        tls = client_tls(args)
    except ConfigError as e:
        print(f"lorarl train: {e}", file=sys.stderr)
        return 2
    if not inputs_ok(cfg):
        return 2
    out = Path(cfg.output.dir)
    rollouts = [a.strip() for a in (args.rollout or "").split(",") if a.strip()]
    out.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()  # a Kubernetes Job deleted, a Slurm job cancelled: stop as Ctrl-C does
    try:
        openai_urls = [u.strip() for u in (args.openai or "").split(",") if u.strip()]
        return asyncio.run(drive(cfg, args.trainer, rollouts, token, out, args.weightsync, fresh=args.fresh,
                                 tls=tls, openai_urls=lambda: openai_urls))
    except KeyboardInterrupt:
        print("lorarl: interrupted. Run the same command again to resume.", file=sys.stderr)
        return 130
    except RUN_ENDING_ERRORS as e:
        return report(e, out)


def report(error: BaseException, out: Path, stack=None) -> int:
    """Ends a run on ``error`` with one line that names the service, the call and what to do."""
    failed = stack.failure if stack is not None else None
    if isinstance(failed, ServiceFailedError):  # the root cause: a service that kept dying
        error = failed
    resume = " The run can resume: run the same command again." if (out / "state.json").exists() else ""
    print(f"lorarl: run failed: {error}.{resume}", file=sys.stderr)
    return 1


def visible_devices(cfg) -> dict[str, dict[str, str]]:
    """Per-process device masks from the placement plan (one node, accelerators only)."""
    from lorarl.client.plan import place

    device = cfg.trainer.device.split(":", 1)[0]
    if not cfg.placement.devices_per_node or device == "cpu":
        return {}
    variable = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}[device]
    masks = {}
    for slot in place(cfg):
        name = slot.role if slot.role == "trainer" or cfg.rollout.replicas > 1 else "rollout"
        masks[name] = {variable: ",".join(str(d) for d in slot.devices)}
    return masks


async def drive(cfg, trainer_address: str, rollout_addresses: str | list[str] | None, token: str | None,
                out: Path, weightsync_address: str | None = None, fresh: bool = False,
                give_up: Callable[[], None] | None = None, tls: ClientTls | None = None,
                openai_urls: Callable[[], list[str]] | None = None) -> int:
    """Creates (or resumes, or re-attaches to) the job, runs the loop, and writes the plot and summary.

    ``rollout_addresses`` empty: the loop learns the rollout replicas from weight sync (lorarl.client.fleet),
    so replicas may join and leave during the run; else that static list (prompts of a replica that fails
    are redone on the others either way)."""
    from lorarl.client.calls import NamedStub
    from lorarl.client.fleet import weightsync_fleet
    from lorarl.client.job_inputs import job_examples, job_reward, job_workflow
    from lorarl.client.loop import RLLoop
    from lorarl.client.preflight import rollout_warnings
    from lorarl.client.recovery import wait_serving
    from lorarl.client.rollout_pool import RolloutPool
    from lorarl.client.run_log import RunLog
    from lorarl.client.session import JobSession
    from lorarl.common.channel import aio_channel
    from lorarl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weightsync_pb2_grpc

    reward, workflow = job_reward(cfg), job_workflow(cfg)
    train, test = job_examples(cfg, "train"), job_examples(cfg, "test")
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    if isinstance(rollout_addresses, str):
        rollout_addresses = [rollout_addresses]
    rollout_addresses = list(rollout_addresses or [])
    if not rollout_addresses and not weightsync_address:
        raise ConfigError("--rollout", "name the rollout replicas, or the weight-sync service to learn them from")
    async with contextlib.AsyncExitStack() as stack:
        channels = {}  # service name -> channel, for the health checks after a fault (same TLS, same token)

        async def channel(service: str, address: str):
            channels[f"{service} at {address}"] = await stack.enter_async_context(
                aio_channel(address, token=token, tls=tls))
            return channels[f"{service} at {address}"]

        replicas: dict[str, NamedStub] = {}  # address -> stub: a replica that leaves and comes back keeps its channel

        async def connect_rollout(address: str) -> NamedStub:
            if address not in replicas:
                ch = await stack.enter_async_context(aio_channel(address, token=token, tls=tls))
                replicas[address] = NamedStub(rollout_pb2_grpc.RolloutServiceStub(ch), "rollout", address)
            return replicas[address]

        trainer = NamedStub(trainer_pb2_grpc.TrainerServiceStub(await channel("trainer", trainer_address)),
                            "trainer", trainer_address)
        weightsync = None
        if weightsync_address:
            weightsync = NamedStub(weightsync_pb2_grpc.WeightSyncServiceStub(
                await channel("weightsync", weightsync_address)), "weightsync", weightsync_address)
        if rollout_addresses:  # a static fleet: every replica is waited for after a fault
            rollout = RolloutPool([NamedStub(rollout_pb2_grpc.RolloutServiceStub(await channel("rollout", a)),
                                             "rollout", a) for a in rollout_addresses])
        else:
            rollout = RolloutPool(discover=weightsync_fleet(weightsync, cfg.job_id), connect=connect_rollout)
        session = JobSession(cfg, trainer, out)
        state = await session.start(fresh=fresh)
        if not rollout_addresses:
            await rollout.wait_members(cfg.recovery.wait_s)
            print("lorarl: rollout replicas (from weight sync): " + ", ".join(
                f"{rollout.names[a]} at {a}" for a in rollout.members), flush=True)
        await rollout_warnings(cfg, rollout.stubs)
        log = RunLog(out, total_steps=cfg.loop.steps, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb,
                     progress=cfg.output.progress, config=to_dict(cfg))
        log.rewind(state.step if state.step else -1)  # rows past the resume point are redone; a fresh run starts clean

        async def recover():
            await wait_serving(channels, cfg.recovery.wait_s, give_up)
            if not rollout_addresses:
                await rollout.wait_members(cfg.recovery.wait_s)
            return await session.recover()

        loop = RLLoop(cfg, trainer, rollout, reward, train, test, log, state=state, on_checkpoint=session.save,
                      weightsync=weightsync, recover=recover, on_rewind=log.rewind, workflow=workflow,
                      openai_urls=openai_urls, token=token)
        try:
            await loop.run()
        finally:
            log.close()
        exported = await trainer.Export(trainer_pb2.ExportRequest(job_id=cfg.job_id, mode=common_pb2.SYNC_MODE_ADAPTER,
                                                                  path=f"{cfg.job_id}/final-adapter"))
    plot = log.plot()
    summary = log.summary()
    (out / "summary.txt").write_text(summary + "\n")
    print("\n" + summary + f"\nplot: {plot}\nmetrics: {log.jsonl_path}\nadapter (PEFT): {exported.path}", flush=True)
    return 0
