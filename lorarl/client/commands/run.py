"""`lorarl run CONFIG [CONFIG ...] [key=value ...]` and `lorarl train CONFIG --trainer A --weightsync A`.

run:   starts the three services on loopback (own processes, free ports, a generated token), runs
       the job, and stops them on success, failure or Ctrl-C; resumes from the run directory's last
       checkpoint when one exists. Several job files: one stack for all of them (one base in the
       trainer, one rollout serving every job's adapters), each job its own loop and output dir;
       the key=value overrides apply to every job. --attach RUN_DIR runs the job on the stack
       that the `lorarl run` writing to RUN_DIR started (which keeps it up until this job ends).
train: the same loop against services already running (compose stack, other hosts); the token
       comes from --token-file (or $LORARL_AUTH_TOKEN_FILE), else $LORARL_AUTH_TOKEN.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from lorarl.client.calls import ServiceCallError, client_token
from lorarl.client.interrupt import run_interruptible, stop_on_sigterm
from lorarl.client.job.inputs import inputs_ok
from lorarl.client.job.resume_check import resume_ok
from lorarl.client.launch.attach import wait_for_attached
from lorarl.client.launch.launcher_record import launcher_recorded
from lorarl.client.launch.local import ServiceFailedError
from lorarl.client.launch.services import check_startable, launch_stack, metrics_line
from lorarl.client.rl.drive import drive
from lorarl.client.rl.recovery import ActivationFailedError, RecoveryExhaustedError
from lorarl.common.channel import ClientTls
from lorarl.common.config import ConfigError
from lorarl.common.preload import in_background
from lorarl.contract.tokenizer import import_in_advance

#: What ends a run with a one-line message instead of a traceback (anything else is a bug: traceback).
RUN_ENDING_ERRORS = (ServiceCallError, RecoveryExhaustedError, ActivationFailedError, RuntimeError, ServiceFailedError)


def add_parsers(subparsers: Any) -> None:
    run = subparsers.add_parser("run", help="start the services on loopback and run a job", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(run)
    run.add_argument("--attach", metavar="RUN_DIR", help="run the job on the services of the `lorarl run` whose "
                     "output dir is RUN_DIR, instead of starting its own (lorarl/client/launch/attach.py)")
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
    parser.add_argument("config", help="job YAML file (see examples/); `run` takes several, before the overrides")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. loop.steps=10")
    parser.add_argument("--dry-run", action="store_true", help="validate the config, print the plan, and exit")
    parser.add_argument("--fresh", action="store_true",
                        help="start the job over: ignore the output dir's resume point (train: delete the job); "
                        "without it, a run that would resume refuses changes to the settings its resume point "
                        "depends on (lorarl/client/job/resume_check.py)")


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
    from lorarl.client.job.config import load_job_config

    try:
        return load_job_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return None


def job_files(args: argparse.Namespace) -> list[str]:
    """The job files named before the overrides (an argument without '=' is a job file); the overrides stay in
    ``args.overrides``."""
    files = [args.config]
    while args.overrides and "=" not in args.overrides[0]:
        files.append(args.overrides.pop(0))
    if any("=" not in item for item in args.overrides):
        raise ConfigError("arguments", "name every job file before the key=value overrides")
    for path in files[1:]:  # checked before anything runs: `loop.steps 8` is a missing '=', not a second job
        if not Path(path).exists() and not path.endswith((".yaml", ".yml", ".json")):
            raise ConfigError("arguments", f"{path!r} is neither a job file nor a key=value override (an override "
                                           f"is written {path}=VALUE)")
    return files


def run_many(args: argparse.Namespace, files: list[str]) -> int:
    """`lorarl run A.yaml B.yaml ...`: every job on one stack (lorarl.client.launch.many_jobs)."""
    from lorarl.client.launch.many_jobs import run_jobs

    cfgs = []
    for path in files:
        args.config = path
        cfg = load(args)
        if cfg is None:
            return 2
        if args.dry_run:
            print(f"== {path} ({cfg.job_id})")
            if code := dry_run(cfg):
                return code
        elif not inputs_ok(cfg) or not resume_ok(as_shared_job(cfg), args.fresh):
            return 2
        cfgs.append(cfg)
    try:
        if args.dry_run:
            from lorarl.client.launch.many_jobs import check_shareable

            check_shareable(cfgs)
            print(f"jobs {', '.join(cfg.job_id for cfg in cfgs)} can share one stack (the base once in the "
                  "trainer, one rollout sized for all)")
            from lorarl.client.job.plan import print_shared_processes, shared_service_plans
            from lorarl.client.launch.many_jobs import shared_sections

            rollout = shared_sections(cfgs, Path(cfgs[0].output.dir))["rollout"]
            print_shared_processes(shared_service_plans(cfgs, rollout))
            return 0
        stop_on_sigterm()
        return run_jobs(cfgs, files, list(args.overrides), args.fresh)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return 2
    except RUN_ENDING_ERRORS as e:
        return report(e, Path(cfgs[0].output.dir))


def as_shared_job(cfg):
    """A copy of ``cfg`` as its `lorarl train` runs it on a stack shared with other jobs (adapters only:
    lorarl.client.launch.many_jobs), for the resume check to compare what that run will record."""
    import copy

    shared = copy.deepcopy(cfg)
    shared.sync.mode = "adapter"
    return shared


def data_ready(cfg, splits: tuple[str, ...] = ("train", "test")) -> bool:
    """The job's data (``splits`` of it) there before the model is fetched or anything starts: a Hub dataset
    (data.dataset) downloaded into the datasets cache, a missing file refused naming its key and what makes it;
    False, said on stderr, otherwise."""
    from lorarl.client.job.inputs import fetch_data

    try:
        fetch_data(cfg, splits)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return False
    return True


def model_ready(cfg) -> bool:
    """A Hub model id in model.path downloaded into the Hugging Face cache (and model.path set to it) before
    anything starts; False, said on stderr, when it cannot be had."""
    from lorarl.client.job.hub import download_model, is_repo_id

    if not is_repo_id(cfg.model.path):
        return True
    try:
        cfg.model.path = download_model(cfg.model.path)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return False
    return True


def dry_run(cfg, own_stack: bool = False) -> int:
    """--dry-run: the memory and placement plan, then the job's own inputs (every row of its data, its
    reward, its workflow); "config OK" only when both hold. A Hub model not in the cache is planned from
    model.shape, and said to be downloaded by `lorarl run`; data that is not there yet (a file to be made, a Hub
    dataset not in the cache) is a WARNING naming its key and what makes it, so a job file checks out on a fresh
    clone (`lorarl run` refuses it, or downloads the Hub dataset, before anything starts)."""
    from lorarl.client.job.hub import is_repo_id
    from lorarl.client.job.inputs import check_inputs
    from lorarl.client.job.plan import print_plan

    if is_repo_id(cfg.model.path):
        print(f"model.path {cfg.model.path}: no local folder of that name, nor a Hugging Face Hub model in the cache "
              "here; `lorarl run` downloads it from the Hub first (the plan reads model.shape meanwhile)")

    code = print_plan(cfg)
    if code:
        return code
    if own_stack and (key := cfg.version_teacher_key()):  # `lorarl run` would refuse it: say so here
        from lorarl.client.launch.services import version_teacher_refusal

        print(f"lorarl: bad config: {key}: {version_teacher_refusal(cfg)}")
        return 2
    try:
        lines = check_inputs(cfg, missing_ok=True)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}")
        return 2
    for line in lines:
        print(line)
    warnings = sum(line.startswith("WARNING") for line in lines)
    print("config OK" + (f", with {warnings} WARNING{'S' if warnings > 1 else ''} above" if warnings else ""))
    return 0


def run_command(args: argparse.Namespace) -> int:
    try:
        files = job_files(args)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return 2
    if getattr(args, "attach", None):
        return attach_run(args, files)
    if len(files) > 1:
        return run_many(args, files)
    cfg = load(args)
    if cfg is None:
        return 2
    if args.dry_run:
        return dry_run(cfg, own_stack=True)
    if cfg.placement.nodes > 1 and cfg.launcher.kind == "local":
        print("lorarl: bad config: placement.nodes: `lorarl run` starts every service on this host; for several "
              "nodes use launcher.kind=ray, or deploy/k8s or deploy/slurm (see examples/models/README.md)",
              file=sys.stderr)
        return 2
    try:
        check_startable(cfg)  # before model_ready, which may download the model
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return 2
    if not resume_ok(cfg, args.fresh):  # a changed job file against the saved state: before any download
        return 2
    if not data_ready(cfg) or not model_ready(cfg) or not inputs_ok(cfg):  # data first: the model may be large
        return 2
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    stack = launch_stack(cfg, out)
    stop_on_sigterm()
    # The loop renders prompts with the model's tokenizer: where that needs transformers' tokenizer classes
    # (~6 s of imports; lorarl.contract.tokenizer), import them while the services start.
    in_background(import_in_advance, cfg.model.path)
    try:
        with launcher_recorded(out / "services"), stack:  # `lorarl stop RUN_DIR` finds this process by it
            rollouts = stack.addresses("rollout")
            print(f"lorarl: services up (trainer {stack.address('trainer')}, rollout {', '.join(rollouts)}, "
                  f"weightsync {stack.address('weightsync')}); logs in {out / 'services'}", flush=True)
            if line := metrics_line(stack, out):
                print(line, flush=True)
            stack.supervise(cfg.recovery.restarts if cfg.recovery.enabled else 0)
            code = run_interruptible(drive(cfg, stack.address("trainer"), None, stack.token, out,
                                     stack.address("weightsync"), fresh=args.fresh, give_up=stack.raise_if_failed,
                                     openai_urls=stack.openai_urls))
            if hasattr(stack, "workdir"):  # a local stack: other runs may have attached to it
                wait_for_attached(stack.workdir, stack.raise_if_failed)
            return code
    except KeyboardInterrupt:
        print("lorarl: interrupted; services stopped. Run the same command again to resume.", file=sys.stderr)
        return 130
    except ConfigError as e:  # the launcher's: no Ray, no cluster at the address, not enough of it
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return 2
    except RUN_ENDING_ERRORS as e:
        return report(e, out, stack)


def attach_run(args: argparse.Namespace, files: list[str]) -> int:
    """`lorarl run JOB.yaml --attach RUN_DIR`: the job on another run's stack, under a lease that keeps it up."""
    from lorarl.client.launch.attach import check_attachable, lease, services_dir, stack_addresses

    if len(files) > 1:
        print("lorarl: bad config: --attach runs one job file", file=sys.stderr)
        return 2
    cfg = load(args)
    if cfg is None:
        return 2
    if args.dry_run:
        return dry_run(cfg)
    try:
        addresses = stack_addresses(args.attach)
        check_attachable(cfg, args.attach)
        token = client_token(str(services_dir(args.attach) / "token"))
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return 2
    if not inputs_ok(cfg):
        return 2
    cfg.sync.mode = "adapter"  # auto or adapter (merged is refused above): a merged version replaces the shared base
    if not resume_ok(cfg, args.fresh):
        return 2
    print(f"lorarl: attached to the services of {args.attach} (trainer {addresses['trainer']}, weightsync "
          f"{addresses['weightsync']})", flush=True)
    return drive_services(cfg, args, addresses["trainer"], [], token, addresses["weightsync"],
                          openai_urls=list(addresses["openai"]), hold=lease(args.attach, cfg.job_id))


def train_command(args: argparse.Namespace) -> int:
    from lorarl.client.commands.serve import ORPHAN_GRACE_S
    from lorarl.common.parent_watch import watch_if_marked

    watch_if_marked(grace_s=ORPHAN_GRACE_S)  # one job of `lorarl run A B`: it stops (resumable) with its launcher
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
    if not inputs_ok(cfg) or not resume_ok(cfg, args.fresh):
        return 2
    rollouts = [a.strip() for a in (args.rollout or "").split(",") if a.strip()]
    openai_urls = [u.strip() for u in (args.openai or "").split(",") if u.strip()]
    return drive_services(cfg, args, args.trainer, rollouts, token, args.weightsync, tls=tls, openai_urls=openai_urls)


def drive_services(cfg, args: argparse.Namespace, trainer: str, rollouts: list[str], token: str | None,
                   weightsync: str, tls: ClientTls | None = None, openai_urls: list[str] | None = None,
                   hold: contextlib.AbstractContextManager | None = None) -> int:
    """The job's loop against services already running (`train`, `run --attach`, inside ``hold``)."""
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()  # a Kubernetes Job deleted, a Slurm job cancelled: stop as Ctrl-C does
    try:
        with hold or contextlib.nullcontext():
            return run_interruptible(drive(cfg, trainer, rollouts, token, out, weightsync, fresh=args.fresh, tls=tls,
                                     openai_urls=lambda: list(openai_urls or [])))
    except KeyboardInterrupt:
        print("lorarl: interrupted. Run the same command again to resume.", file=sys.stderr)
        return 130
    except ConfigError as e:  # found once the services answer: a teacher weight sync cannot give (JOB@vN)
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return 2
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


