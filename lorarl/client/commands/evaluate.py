"""`lorarl eval CONFIG [--adapter DIR ...] [--base] [key=value ...]` and `lorarl export`.

eval:   held-out greedy accuracy of the config's base model, or of PEFT adapter directories (e.g. a
        `lorarl export` or the trainer's Export) served on top of it, each in turn, through one rollout
        service started on loopback for the purpose; one JSON line of scores per target, the base first.
export: a job's adapter (PEFT) or merged model (HF) on disk, either from a training checkpoint with
        nothing running (`lorarl export --checkpoint DIR --mode merged --out DIR`), or by asking a
        running trainer (`lorarl export JOB --trainer HOST:PORT`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lorarl.client.commands.run import add_token_file, client_tls
from lorarl.contract import versions
from lorarl.contract.peft import read_peft_config, read_peft_tensors

ADAPTER_JOB = "eval-adapter"


def add_parsers(subparsers: Any) -> None:
    ev = subparsers.add_parser("eval", help="held-out accuracy of a base model or an adapter", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("config", help="job YAML file (model, data and rollout sections are used)")
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    ev.add_argument("--adapter", metavar="DIR", action="append", default=[],
                    help="PEFT adapter directory to serve on the base model (again for more: one rollout scores all)")
    ev.add_argument("--base", action="store_true", help="with --adapter: score the base model too, first")
    ev.set_defaults(handler=eval_command)
    ex = subparsers.add_parser("export", help="write a job's adapter or merged model, from a checkpoint or a trainer",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ex.add_argument("job_id", nargs="?", help="the job, with --trainer")
    source = ex.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a training checkpoint (runs/<job>/checkpoints/...)")
    source.add_argument("--trainer", metavar="HOST:PORT", help="a running trainer that holds the job")
    ex.add_argument("--mode", choices=["adapter", "merged"], default="adapter")
    ex.add_argument("--out", metavar="DIR", help="output directory, with --checkpoint")
    ex.add_argument("--base-model", metavar="DIR", help="with --checkpoint: the base model, if not where the "
                                                        "checkpoint recorded it")
    ex.add_argument("--path", default="", help="with --trainer: directory on the trainer's side (default: under its "
                                               "export_dir)")
    add_token_file(ex)
    ex.set_defaults(handler=export_command)


def read_adapter(directory: Path) -> tuple[dict, dict]:
    """(adapter_config.json, tensors) of a PEFT adapter directory; ValueError says what is missing."""
    return read_peft_config(directory), read_peft_tensors(directory)


def eval_command(args: argparse.Namespace) -> int:
    from lorarl.client.commands.run import data_ready, load
    from lorarl.client.interrupt import run_interruptible, stop_on_sigterm
    from lorarl.client.launch.local import LocalStack
    from lorarl.client.launch.services import stack_sections

    cfg = load(args)
    if cfg is None or not data_ready(cfg, ("test",)):  # the held-out split there before the rollout starts
        return 2
    try:
        adapters = [read_adapter(Path(directory)) for directory in args.adapter]
    except ValueError as e:
        print(f"lorarl eval: {e}", file=sys.stderr)
        return 2
    names = ["base"] * (args.base or not adapters) + list(args.adapter)
    targets = [None] * (args.base or not adapters) + adapters
    out = Path(cfg.output.dir) / "eval"
    sections = stack_sections(cfg, Path(cfg.output.dir))
    stop_on_sigterm()  # a supervisor's stop ends the evaluation and stops its rollout, as Ctrl-C does
    try:
        with LocalStack(out / "services", {"rollout": sections["rollout"]}, services=("rollout",)) as stack:
            results = run_interruptible(evaluate(cfg, stack.address("rollout"), stack.token, targets))
    except KeyboardInterrupt:
        print("lorarl eval: interrupted; its rollout is stopped", file=sys.stderr)
        return 130
    for name, result in zip(names, results, strict=True):
        print(json.dumps({**result, "target": name}))
    return 0


async def evaluate(cfg, rollout_address: str, token: str | None, targets: list[tuple[dict, dict] | None]
                   ) -> list[dict[str, float]]:
    """The held-out scores of each target in turn on one rollout: None is the base model, else a PEFT adapter
    (config, tensors), loaded as the next version of one evaluation job (the trainer's adapters, compared under
    one evaluator: bench/lorarl_job.py too)."""
    import copy

    from lorarl.client.job.inputs import job_examples, job_reward
    from lorarl.client.rl.loop import LoopState, RLLoop
    from lorarl.common.channel import aio_channel
    from lorarl.contract.lora import LoraSpec
    from lorarl.rollout.client import load_weights_stream
    from lorarl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    cfg = copy.deepcopy(cfg)
    cfg.job_id = ADAPTER_JOB
    test, reward = job_examples(cfg, "test"), job_reward(cfg)
    results, version = [], versions.BASE
    async with aio_channel(rollout_address, token=token) as channel:
        rollout = rollout_pb2_grpc.RolloutServiceStub(channel)
        caps = await rollout.GetCapabilities(rollout_pb2.GetCapabilitiesRequest())
        for target in targets:
            state = LoopState()
            if target is not None:
                config, tensors = target
                version = versions.next_version(version)
                await rollout.LoadWeights(load_weights_stream(ADAPTER_JOB, version, tensors,
                                                              common_pb2.SYNC_MODE_ADAPTER,
                                                              caps.base_model_fingerprint,
                                                              LoraSpec.from_peft_config(config).to_proto()))
                state.version = version
            loop = RLLoop(cfg, trainer=None, rollout=rollout, reward=reward, train=test, test=test,
                          on_metrics=lambda m: None, state=state)
            results.append(await loop.evaluate())
    return results


def export_command(args: argparse.Namespace) -> int:
    if args.checkpoint:
        return export_checkpoint_command(args)
    if not args.job_id:
        print("lorarl export: --trainer needs the JOB to export", file=sys.stderr)
        return 2
    from lorarl.common.channel import sync_channel
    from lorarl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

    mode = common_pb2.SYNC_MODE_MERGED if args.mode == "merged" else common_pb2.SYNC_MODE_ADAPTER
    from lorarl.client.calls import client_token
    from lorarl.common.config import ConfigError

    try:
        token, tls = client_token(args.token_file), client_tls(args)
    except ConfigError as e:
        print(f"lorarl export: {e}", file=sys.stderr)
        return 2
    with sync_channel(args.trainer, token=token, tls=tls) as channel:
        response = trainer_pb2_grpc.TrainerServiceStub(channel).Export(
            trainer_pb2.ExportRequest(job_id=args.job_id, mode=mode, path=args.path), timeout=600)
    print(response.path)
    return 0


def export_checkpoint_command(args: argparse.Namespace) -> int:
    """Offline export; a missing, corrupt or foreign checkpoint is a one-line error and exit code 2."""
    if not args.out:
        print("lorarl export: --checkpoint needs --out DIR", file=sys.stderr)
        return 2
    if args.job_id or args.path:
        print("lorarl export: JOB and --path go with --trainer, not --checkpoint", file=sys.stderr)
        return 2
    from lorarl.trainer.engines.checkpoint import CheckpointError
    from lorarl.trainer.engines.offline_export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.mode, args.base_model)
    except CheckpointError as e:
        print(f"lorarl export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
