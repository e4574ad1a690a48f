"""lorarl from Python: connect to running services, train an adapter call by call, sample from any policy
version, or run a whole job exactly as `lorarl run` does.

    from lorarl.client.sdk import RLJob, ServiceClient, local_services

    RLJob("examples/demo.yaml", ["loop.steps=20"]).run()          # the whole loop, like `lorarl run`

    with local_services("examples/demo.yaml") as services:        # or ServiceClient(trainer=..., token=...)
        trainer = services.training_client("examples/demo.yaml")  # creates the job (its LoRA, loss, optimiser)
        sampler = services.sampling_client(trainer.job_id)
        samples = sampler.sample("12+34=", n=8)                   # tokens, logprobs, versions
        trainer.forward_backward([...])                           # trajectories: Episodes, dicts or protos
        trainer.optim_step()
        trainer.publish()                                         # the rollouts serve the new version

Every call is the gRPC call the CLI makes (no second implementation); failures raise
lorarl.client.calls.ServiceCallError naming the service, its address, the call and the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lorarl.client.calls import ServiceCallError, client_token
from lorarl.client.job.config import JobFileConfig, base_model_name, load_job_config, training_spec
from lorarl.client.rl.loop import job_config_proto
from lorarl.client.workflow import Episode, Sampled
from lorarl.common.channel import ClientTls, sync_channel
from lorarl.contract.chat import ChatRenderer
from lorarl.contract.enums import LOSS_TYPES, SYNC_MODES
from lorarl.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

Trajectoryish = Episode | Mapping[str, Any] | common_pb2.Trajectory


def _config(config: str | Path | JobFileConfig | None, overrides: Sequence[str]) -> JobFileConfig:
    if isinstance(config, JobFileConfig):
        if not overrides:
            return config
        cfg = load_job_config(None, [*_as_overrides(config), *overrides])
        cfg.job_dir = getattr(config, "job_dir", "")
        if not any(o.startswith("model.path=") for o in overrides):  # the base keeps the name the job gave it
            cfg.model_name = base_model_name(config)
        return cfg
    return load_job_config(str(config) if config is not None else None, list(overrides))


def _as_overrides(cfg: JobFileConfig) -> list[str]:
    from lorarl.common.config import to_dict

    flat: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        elif value is not None:
            flat.append(f"{prefix}={value}")

    walk("", to_dict(cfg))
    return flat


def trajectory(item: Trajectoryish, job_id: str, index: int) -> common_pb2.Trajectory:
    """An Episode, a dict (prompt_ids, completion_ids, reward; logprobs, versions, loss_mask, group_id
    optional) or a Trajectory as the trainer's Trajectory."""
    if isinstance(item, common_pb2.Trajectory):
        out = common_pb2.Trajectory()
        out.CopyFrom(item)
        out.job_id = out.job_id or job_id
        return out
    if isinstance(item, Episode):
        return item.to_proto(job_id, f"sdk-{index}", item.group_id)
    try:
        completion = [int(t) for t in item["completion_ids"]]
        episode = Episode([int(t) for t in item["prompt_ids"]], group_id=str(item.get("group_id", "")))
    except KeyError as e:
        raise ValueError(f"trajectory {index}: a dict needs prompt_ids and completion_ids (missing {e})") from None
    n = len(completion)
    episode.completion_ids = completion
    episode.loss_mask = [bool(m) for m in item.get("loss_mask") or [True] * n]
    episode.logprobs = [float(x) for x in item.get("logprobs") or [0.0] * n]
    episode.versions = [int(v) for v in item.get("versions") or [0] * n]
    episode.reward = float(item.get("reward", 0.0))
    return episode.to_proto(job_id, f"sdk-{index}", episode.group_id)


class _Stub:
    """A generated stub whose failures raise ServiceCallError (service, address, call, status)."""

    def __init__(self, stub: Any, service: str, address: str) -> None:
        self._stub, self.service, self.address = stub, service, address

    def __getattr__(self, method: str) -> Any:
        call = getattr(self._stub, method)

        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except grpc.RpcError as e:
                raise ServiceCallError(self.service, self.address, method, e.code(), e.details() or "") from None
        return checked


class ServiceClient:
    """Connections to running services (any may be left out): the entry point of the SDK."""

    def __init__(self, trainer: str = "", rollout: str | Sequence[str] = "", weightsync: str = "", *,
                 token: str | None = None, token_file: str | None = None, tls: ClientTls | None = None) -> None:
        self.token = token if token is not None else client_token(token_file)
        self.addresses = {"trainer": trainer, "weightsync": weightsync}
        self.rollouts = [rollout] if isinstance(rollout, str) else list(rollout)
        self.rollouts = [r for r in self.rollouts if r]
        self._channels: list[grpc.Channel] = []
        self.tls = tls

    def _stub(self, service: str, address: str, stub_class: type) -> _Stub:
        if not address:
            raise ValueError(f"no {service} address: pass {service}= to ServiceClient")
        channel = sync_channel(address, token=self.token, tls=self.tls)
        self._channels.append(channel)
        return _Stub(stub_class(channel), service, address)

    def training_client(self, config: str | Path | JobFileConfig | None = None, overrides: Sequence[str] = (), *,
                        fresh: bool = True) -> TrainingClient:
        """A job on the trainer, created from a job file (its model, LoRA, loss, optimiser, memory settings);
        ``fresh``: an existing job of that id is deleted first, else it is attached to."""
        cfg = _config(config, overrides)
        stub = self._stub("trainer", self.addresses["trainer"], trainer_pb2_grpc.TrainerServiceStub)
        if fresh:
            with contextlib.suppress(ServiceCallError):
                stub.DeleteJob(trainer_pb2.DeleteJobRequest(job_id=cfg.job_id))
        created = stub.CreateJob(trainer_pb2.CreateJobRequest(
            job_id=cfg.job_id, config=job_config_proto(cfg, str(Path(cfg.model.path).resolve())), attach=True))
        return TrainingClient(stub, cfg, int(created.job.version), int(created.job.step))

    def sampling_client(self, job_id: str = "", version: int = 0, *, model_path: str = "",
                        replica: int = 0) -> SamplingClient:
        """Samples from ``job_id``'s policy (version 0: its latest; no job: the base model)."""
        if not self.rollouts:
            raise ValueError("no rollout address: pass rollout= to ServiceClient")
        address = self.rollouts[replica % len(self.rollouts)]
        stub = self._stub("rollout", address, rollout_pb2_grpc.RolloutServiceStub)
        return SamplingClient(stub, job_id, version, model_path)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class TrainingClient:
    """One job on the trainer, driven call by call (Tinker-style): gradients, steps, logprobs, state, export."""

    stub: Any
    cfg: JobFileConfig
    version: int
    step: int

    @property
    def job_id(self) -> str:
        return self.cfg.job_id

    def _trajectories(self, batch: Sequence[Trajectoryish]) -> list[common_pb2.Trajectory]:
        if not batch:
            raise ValueError("an empty batch")
        return [trajectory(item, self.job_id, i) for i, item in enumerate(batch)]

    def forward_backward(self, batch: Sequence[Trajectoryish], loss: str | None = None) -> dict[str, float]:
        """Accumulates the loss's gradients over ``batch`` (the job's loss, or another family by name)."""
        request = trainer_pb2.ForwardBackwardRequest(job_id=self.job_id, trajectories=self._trajectories(batch))
        if loss is not None:
            if loss not in LOSS_TYPES:
                raise ValueError(f"loss must be one of {sorted(LOSS_TYPES)}, got {loss!r}")
            job_loss = training_spec(self.cfg, self.cfg.model.path).loss
            request.loss.CopyFrom(dataclasses.replace(job_loss, type=loss).to_proto())
        return dict(self.stub.ForwardBackward(request).metrics.values)

    def optim_step(self, learning_rate: float | None = None) -> dict[str, float]:
        """Applies the accumulated gradients; the policy version goes up by one."""
        reply = self.stub.OptimStep(trainer_pb2.OptimStepRequest(job_id=self.job_id,
                                                                 learning_rate=learning_rate or 0.0))
        self.version, self.step = int(reply.version), int(reply.step)
        return dict(reply.metrics.values)

    def compute_logprobs(self, batch: Sequence[Trajectoryish], reference: bool = False) -> list[list[float]]:
        """Each trajectory's completion-token logprobs under the current policy (``reference``: the base)."""
        reply = self.stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(
            job_id=self.job_id, trajectories=self._trajectories(batch), reference=reference))
        return [list(r.logprobs) for r in reply.results]

    def save_state(self, name: str) -> str:
        """Adapter, optimiser and RNG state as a checkpoint named ``name``; its path on the trainer."""
        return self.stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id=self.job_id,
                                                                         path=f"{self.job_id}/{name}")).path

    def load_state(self, path: str) -> int:
        reply = self.stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(job_id=self.job_id, path=path))
        self.version, self.step = int(reply.version), int(reply.step)
        return self.version

    def export(self, path: str = "", mode: str = "adapter") -> str:
        """The policy as a PEFT adapter (or merged HF weights, ``mode="merged"``); its path on the trainer."""
        return self.stub.Export(trainer_pb2.ExportRequest(job_id=self.job_id, mode=SYNC_MODES[mode],
                                                          path=path or f"{self.job_id}/export-v{self.version}")).path

    def publish(self, wait: bool = True, timeout_s: int = 600) -> int:
        """Sends the current version to the rollouts (through weight sync); with ``wait``, until they serve it."""
        reply = self.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(
            job_id=self.job_id, mode=SYNC_MODES[self.cfg.sync.mode], wait_for_activation=wait,
            timeout_seconds=timeout_s))
        if wait and not reply.activated:
            raise RuntimeError(f"version {reply.version} was not activated: {reply.error}")
        return int(reply.version)


@dataclass
class SamplingClient:
    """Completions from one policy: a job's latest version or a pinned one, or the base model."""

    stub: Any
    job_id: str = ""
    version: int = 0
    model_path: str = ""

    def policy(self) -> rollout_pb2.PolicySelector:
        return rollout_pb2.PolicySelector(job_id=self.job_id, version=self.version if self.job_id else 0)

    def sample(self, prompt: str | Sequence[int], n: int = 1, *, max_tokens: int = 0, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               chat: bool = True) -> tuple[list[int], list[Sampled]]:
        """(the prompt's token ids, ``n`` completions); a text prompt is a user turn (``chat``) or raw text."""
        if isinstance(prompt, str):
            message = rollout_pb2.Prompt(text=prompt, apply_chat_template=chat)
        else:
            message = rollout_pb2.Prompt(token_ids=list(prompt))
        params = common_pb2.SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                           stop=list(stop))
        if seed is not None:
            params.seed = seed
        reply = self.stub.Generate(rollout_pb2.GenerateRequest(prompts=[message], sampling=params,
                                                               policy=self.policy()))
        (result,) = reply.results
        return list(result.prompt_token_ids), [Sampled.from_proto(c) for c in result.completions]

    def renderer(self) -> ChatRenderer:
        if not self.model_path:
            raise ValueError("pass model_path= to sampling_client to render chats here")
        return ChatRenderer(self.model_path)


@contextlib.contextmanager
def local_services(config: str | Path | JobFileConfig, overrides: Sequence[str] = (), *,
                   out: str | Path | None = None) -> Iterator[ServiceClient]:
    """The job's three services started on this machine (as `lorarl run` starts them) and a client on them."""
    from lorarl.client.launch.services import local_stack

    cfg = _config(config, overrides)
    stack = local_stack(cfg, Path(out or cfg.output.dir))
    with stack:
        client = ServiceClient(stack.address("trainer"), stack.addresses("rollout"), stack.address("weightsync"),
                               token=stack.token)
        try:
            yield client
        finally:
            client.close()


class RLJob:
    """A whole job, exactly as `lorarl run CONFIG OVERRIDES` runs it (its services started here), or on
    running services with ``ServiceClient`` addresses (as `lorarl train` does)."""

    def __init__(self, config: str | Path | JobFileConfig, overrides: Sequence[str] = (), *, fresh: bool = False,
                 services: ServiceClient | None = None) -> None:
        self.cfg = _config(config, overrides)
        self.fresh, self.services = fresh, services

    def run(self) -> list[dict[str, float]]:
        """Trains to the end; returns the run's metrics rows (what metrics.jsonl holds). Raises on failure."""
        import json

        from lorarl.client.job.inputs import inputs_ok
        from lorarl.client.launch.services import local_stack
        from lorarl.client.rl.drive import drive

        if not inputs_ok(self.cfg):
            raise ValueError("the job's inputs do not check out (see the message above)")
        out = Path(self.cfg.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.services is not None:
            s = self.services
            code = asyncio.run(drive(self.cfg, s.addresses["trainer"], s.rollouts, s.token, out,
                                     s.addresses["weightsync"], fresh=self.fresh, tls=s.tls))
        else:
            stack = local_stack(self.cfg, out)
            with stack:
                stack.supervise(self.cfg.recovery.restarts if self.cfg.recovery.enabled else 0)
                code = asyncio.run(drive(self.cfg, stack.address("trainer"), stack.addresses("rollout"), stack.token,
                                         out, stack.address("weightsync"), fresh=self.fresh,
                                         give_up=stack.raise_if_failed, openai_urls=stack.openai_urls))
        if code:
            raise RuntimeError(f"the job ended with exit code {code}")
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
