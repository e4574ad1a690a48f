"""GenerationEngine on vLLM's AsyncLLM: continuous batching, run-time LoRA, in-place weight reloads.

Every segment the core submits is one AsyncLLM request, so concurrent RPCs are batched by vLLM's
scheduler, never serialised here. AsyncLLM runs its engine core in a child process; adapters and
merged weights reach it as safetensors bytes through the worker extension in
lorarl/rollout/vllm/worker_ext.py (the only code that knows vLLM internals). With
adapter_source 'shm' adapters go through PEFT directories on a tmpfs instead, which needs only
vLLM's public `add_lora`.

vLLM is imported on start(), not at module import, so `lorarl serve rollout` starts fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lorarl.common import ascend
from lorarl.common.cpu_affinity import available_cpus, format_cpu_list, parse_cpu_list
from lorarl.common.errors import FailedPreconditionError, UnavailableError
from lorarl.common.vllm_lora import lora_blocker
from lorarl.contract.lora import LoraSpec
from lorarl.contract.peft import write_peft_files
from lorarl.contract.routes import RoutedExperts
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.schema import (
    AdapterHandle,
    EngineInfo,
    EngineStats,
    Finish,
    SegmentEvent,
    SegmentSpec,
)
from lorarl.rollout.vllm import compat, core_process
from lorarl.rollout.vllm.cpu_binding import apply_thread_binding
from lorarl.rollout.vllm.weight_names import UNCHECKED
from lorarl.rollout.vllm.worker_ext import EXTENSION_QUALNAME, MEMORY_SCHEME

logger = logging.getLogger(__name__)

#: Merged weights travel to the engine process in blobs of at most this many bytes.
BLOB_BYTES = 256 << 20
_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH}


def lora_support(files: ModelFiles, device_type: str, environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """Whether vLLM can run LoRA on this model here, and why not (weight sync's AUTO mode reads it)."""
    blocker = lora_blocker(files.is_moe, device_type, files.config, environ)
    if blocker:
        return False, f"{files.architecture}: {blocker}; serve it with merged weights (mode 2)"
    return True, ""


def safetensors_blobs(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int = BLOB_BYTES
                      ) -> Iterable[bytes]:
    """Serialises (name, tensor) pairs into safetensors blobs of bounded size (always copies)."""
    from safetensors.torch import save

    group: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights:
        t = tensor.detach().to("cpu").contiguous()
        if group and size + t.nbytes > max_bytes:
            yield save(group)
            group, size = {}, 0
        group[name] = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
        size += t.nbytes
    if group:
        yield save(group)



class ReceivedTensors(dict):
    """Tensors the engine's worker received itself (VllmEngine.receive_in_worker), seen here as meta
    tensors of the right dtype and shape: checks read their shapes, the engine finds the bytes by token."""

    def __init__(self, token: str, specs: Mapping[str, tuple[str, list[int]]]) -> None:
        super().__init__({name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                          for name, (dtype, shape) in specs.items()})
        self.engine_token = token


def received_token(tensors: object) -> str | None:
    return getattr(tensors, "engine_token", None)


def engine_memory_args(s: RolloutSettings, on_cpu: bool) -> dict[str, Any]:
    """vLLM's graph and memory arguments for this platform: eager and a 1 GiB KV cache on CPU unless set;
    on GPUs CUDA graphs, and the KV cache sized by gpu_memory_utilization unless kv_cache_gib is set."""
    args: dict[str, Any] = {"enforce_eager": on_cpu if s.enforce_eager is None else s.enforce_eager}
    kv_gib = s.kv_cache_gib if s.kv_cache_gib is not None else (1.0 if on_cpu else None)
    if kv_gib is not None:
        args["kv_cache_memory_bytes"] = int(kv_gib * (1 << 30))
    if s.gpu_memory_utilization is not None and not on_cpu:
        args["gpu_memory_utilization"] = s.gpu_memory_utilization
    return args

class RouteTaker:
    """Takes finished requests' routes from the recording worker (route_recorder.py), many per call: the
    requests that finish in one engine output share one collective_rpc instead of one each."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._pending: dict[str, asyncio.Future[RoutedExperts | None]] = {}
        self._flushing: asyncio.Task[None] | None = None
        self._forgotten: list[str] = []

    async def take(self, request_id: str) -> RoutedExperts | None:
        future: asyncio.Future[RoutedExperts | None] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush())
        return await future

    def forget(self, request_id: str) -> None:
        """An aborted request's routes are dropped with the next take (nobody will ask for them)."""
        self._forgotten.append(request_id)

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the other requests of this engine output join
        pending, self._pending, self._flushing = self._pending, {}, None
        forgotten, self._forgotten = self._forgotten, []
        try:
            if forgotten:
                await self._llm.collective_rpc("lorarl_forget_routes", kwargs={"request_ids": forgotten})
            taken = (await self._llm.collective_rpc("lorarl_take_routes", kwargs={"request_ids": list(pending)}))[0]
        except BaseException as exc:
            for future in pending.values():
                if not future.done():
                    future.set_exception(exc)
            return
        for request_id, future in pending.items():
            fields = taken.get(request_id)
            if not future.done():
                future.set_result(None if fields is None else RoutedExperts(
                    np.frombuffer(fields["data"], dtype=np.int16).reshape(
                        fields["positions"], fields["layers"], fields["top_k"]).copy(), int(fields["num_experts"])))


def shared_base_args(settings: RolloutSettings, files: ModelFiles, enable_lora: bool, cpu: bool) -> dict[str, Any]:
    """vLLM's load settings for an engine whose weights are the co-located job's shared base (rollout.shared_base,
    lorarl.rollout.vllm.shared_loader); empty without one. ValueError where it cannot be: not on CPU (the CUDA IPC
    path is not built), or an engine without LoRA (a MoE on vLLM CPU): its versions would be merged into the base."""
    if not settings.shared_base:
        return {}
    if not cpu:
        raise ValueError("rollout.shared_base: the shared base is built for CPU hosts only (shared memory); on "
                         "accelerators each service still loads its own copy")
    if not enable_lora:
        raise ValueError(f"rollout.shared_base: this engine serves no LoRA ({files.architecture}), so every version "
                         "would be merged into the shared base the trainer computes on; co-location needs an "
                         "engine that serves adapters")
    from lorarl.rollout.vllm.shared_loader import LOAD_FORMAT, register

    register()
    path = settings.shared_base
    if path.startswith("/proc/self/"):  # the launcher's descriptor, named so an engine-core child can open it too
        path = f"/proc/{os.getpid()}/" + path.removeprefix("/proc/self/")
    return {"load_format": LOAD_FORMAT,
            "model_loader_extra_config": {"segment": path, "fingerprint": files.fingerprint()}}


class VllmEngine:
    """GenerationEngine backed by vllm.v1 AsyncLLM (see module docstring)."""

    serves_prompt_logprobs = True  # SamplingParams.prompt_logprobs

    def __init__(self, settings: RolloutSettings) -> None:
        if settings.model_path is None:
            raise ValueError("rollout.model_path is required to start an engine")
        self.settings = settings
        self.files = ModelFiles(settings.model_path)
        self.info: EngineInfo
        self._llm: Any = None
        self._live = 0  # requests handed to vLLM and not yet finished
        self._peak = 0
        self._lora_requests: dict[int, Any] = {}
        self._shm_root: Path | None = None
        self.weight_version = ""  # label of the merged weights served, "" for the base model
        self.receives_in_worker = False  # rollout.receive_in_worker, resolved for this platform on start()
        #: vLLM worker processes (one per tensor-parallel rank); each joins an in-worker receive with its own rank.
        self.worker_count = settings.tensor_parallel_size
        #: checkpoint names the model's own loader writes into a parameter (weight_names.py), set on start()
        self.loaded_weight_names: frozenset[str] | None = None
        #: why this engine cannot take merged weights ("" when it can): captured graphs + per-tensor reload
        self.merged_refusal = ""
        self._routes: RouteTaker | None = None  # rollout.record_routes: the worker records each request's routes

    # --------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker inside the engine-core process
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        if current_platform.device_type == "npu":
            problems = ascend.rollout_problems(s.block_size, s.dtype, block_key="rollout.block_size",
                                               dtype_key="rollout.dtype")
            if s.enable_lora is not False:
                problems += ascend.lora_rank_problems(s.max_lora_rank, rank_key="rollout.max_lora_rank")
            if problems:
                raise ValueError("; ".join(problems))
        compat.disable_envs_cache()  # an engine started before in this process froze vLLM's environment reads
        compat.apply_platform_environment(current_platform.device_type)  # before vLLM loads the model
        if current_platform.is_cpu():
            apply_thread_binding(parse_cpu_list(s.engine_cpus) if s.engine_cpus else available_cpus(),
                                 self.worker_count)
        supported, reason = lora_support(self.files, current_platform.device_type)
        enable_lora = supported if s.enable_lora is None else s.enable_lora
        if enable_lora and not supported:
            raise ValueError(f"rollout.enable_lora is true but {reason}")
        if not enable_lora and supported:
            reason = "the engine was started with rollout.enable_lora=false"
        if s.record_routes and not self.files.is_moe:
            raise ValueError(f"rollout.record_routes: {self.files.architecture} has no MoE layers to record")
        shared = shared_base_args(s, self.files, enable_lora, current_platform.is_cpu())
        args = AsyncEngineArgs(
            model=str(self.files.root),
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            **engine_memory_args(s, current_platform.is_cpu()),
            seed=s.seed,
            max_num_seqs=s.max_num_seqs,
            block_size=s.block_size,
            tensor_parallel_size=s.tensor_parallel_size,
            max_num_batched_tokens=s.max_num_batched_tokens,
            **({"long_prefill_token_threshold": s.long_prefill_tokens} if s.long_prefill_tokens else {}),
            max_logprobs=max(s.max_logprobs, 1),
            logprobs_mode=s.logprobs_mode,
            enable_lora=enable_lora,
            max_lora_rank=s.max_lora_rank if enable_lora else 16,
            max_loras=s.max_loras if enable_lora else 1,
            max_cpu_loras=s.max_loras if enable_lora else None,
            worker_extension_cls=EXTENSION_QUALNAME,
            disable_log_stats=True,
            # a prefix-cached position is never computed, so its route would never be recorded
            **({"enable_prefix_caching": False} if s.record_routes else {}),
            **shared,
        )
        caller = os.environ.get(core_process.ENV)  # read before vLLM's config sets it
        method = core_process.start_method(current_platform.device_type)
        config = args.create_engine_config()
        # No stat loggers: with any, vLLM records Prometheus histograms and iteration stats for every
        # request at every step in the frontend (~15% of its CPU on the demo); stats() counts requests here.
        with core_process.starting_children(method, caller):
            self._llm = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
        # vLLM reads its settings from the environment on every access (every request's SamplingParams
        # looks up VLLM_MAX_N_SEQUENCES: ~14% of this process's CPU on the demo). vLLM's own servers and
        # engine core freeze them once the engine is up; so does this frontend.
        compat.enable_envs_cache()
        self.info = EngineInfo(
            engine="vllm",
            model_path=str(self.files.root),
            architecture=self.files.architecture,
            vocab_size=self.files.vocab_size,
            max_model_len=int(self._llm.model_config.max_model_len),
            eos_token_ids=self.files.eos_token_ids,
            is_moe=self.files.is_moe,
            supports_lora=enable_lora,
            lora_reason="" if enable_lora else reason,
            max_lora_rank=s.max_lora_rank if enable_lora else 0,
            max_loras=s.max_loras if enable_lora else 0,
            dtype=str(self._llm.model_config.dtype).removeprefix("torch."),
        )
        self.receives_in_worker = s.receive_in_worker == "on" or (
            s.receive_in_worker == "auto" and not current_platform.is_cpu())
        if s.shared_base:  # merged weights would be written into the trainer's base (the policy manager refuses first)
            self.merged_refusal = s.base_write_refusal()
        if current_platform.is_cpu():
            await self._llm.collective_rpc("lorarl_install_cpu_fixes")
        if current_platform.device_type == "npu":
            npu = (await self._llm.collective_rpc("lorarl_install_npu_fixes"))[0]
            logger.info("NPU worker: merged weights reload the %s way; %d expert weight loaders restored",
                        npu["reload_way"], npu["loaders_restored"])
            if npu["reload_way"] == "per_tensor" and not args.enforce_eager:
                [self.merged_refusal] = ascend.merged_reload_problems(s.enforce_eager,
                                                                      eager_key="rollout.enforce_eager")
        await self._learn_weight_names()
        if s.record_routes:
            dims = (await self._llm.collective_rpc("lorarl_record_routes",
                                                   kwargs={"max_requests": s.max_recorded_requests}))[0]
            self._routes = RouteTaker(self._llm)
            logger.info("recording routed experts: %d MoE layers, top-%d of %d experts (prefix caching off)",
                        dims["layers"], dims["top_k"], dims["num_experts"])
            if dims.get("warning"):
                logger.warning("%s", dims["warning"])
        if s.engine_cpus and self.worker_count == 1:  # several workers: each is bound by apply_thread_binding
            pinned = await self._llm.collective_rpc("lorarl_pin_cpus", kwargs={"cpus": parse_cpu_list(s.engine_cpus)})
            logger.info("vLLM engine core pinned to CPUs %s", format_cpu_list(pinned[0]))
        if enable_lora and s.adapter_source == "shm":
            self._shm_root = Path(s.shm_dir) / f"lorarl-rollout-{os.getpid()}-{id(self):x}"
            self._shm_root.mkdir(parents=True, exist_ok=True)

    async def _learn_weight_names(self) -> None:
        """Asks the worker where its loader puts each checkpoint tensor (worker_ext.lorarl_weight_targets)."""
        files = self.files
        shapes = {n: (str(files.dtype(n)).removeprefix("torch."), list(files.shape(n) or ()))
                  for n in files.weight_names()}
        targets = (await self._llm.collective_rpc("lorarl_weight_targets", kwargs={"shapes": shapes}))[0]
        self.loaded_weight_names = frozenset(n for n, where in targets.items() if where)
        unchecked = sorted(n for n, where in targets.items() if where and where[0].startswith(UNCHECKED))
        if unchecked:
            logger.warning("the loader's dry run could not settle where %d checkpoint tensors land (counted as "
                           "loaded): %s", len(unchecked), unchecked[:8])
        skipped = sorted(set(shapes) - self.loaded_weight_names)
        if skipped:
            logger.info("checkpoint tensors this engine's loader does not load (an update naming one fails): %s",
                        skipped[:8] + ([f"... {len(skipped) - 8} more"] if len(skipped) > 8 else []))

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # stop reading outputs first, or it logs the engine's exit as a failure
                handler.cancel()
            await asyncio.to_thread(llm.shutdown)
        if self._shm_root is not None:
            shutil.rmtree(self._shm_root, ignore_errors=True)

    async def wait_dead(self, poll_s: float = 1.0) -> str:
        """vLLM's engine core is a child process: its death leaves the frontend answering EngineDeadError."""
        while self._llm is None or not self._llm.errored:
            await asyncio.sleep(poll_s)
        return "vLLM's engine core died (EngineDeadError); its log is above"

    @property
    def llm(self) -> Any:
        """The AsyncLLM itself, for benchmarks (raw-engine baselines) and diagnostics."""
        return self._llm

    async def probe(self) -> dict[str, bool]:
        """Which vLLM internals the worker extension relies on are present (see lorarl/rollout/vllm/worker_ext.py)."""
        return (await self._llm.collective_rpc("lorarl_probe"))[0]

    # ---------------------------------------------------------------------------- requests

    def _params(self, spec: SegmentSpec) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = spec.sampling
        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=0 if s.top_k in (0, -1) else s.top_k,
            max_tokens=s.max_tokens, stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None,
            seed=s.seed, logprobs=s.logprobs, ignore_eos=s.ignore_eos, detokenize=bool(s.stop),
            prompt_logprobs=s.logprobs if s.prompt_logprobs else None,
            output_kind=RequestOutputKind.DELTA if spec.stream else RequestOutputKind.FINAL_ONLY,
            skip_clone=True,  # made fresh for this one request: vLLM need not deep-copy it again
        )

    async def submit(self, spec: SegmentSpec) -> AsyncIterator[SegmentEvent]:
        lora = self._lora_requests.get(spec.adapter.lora_int_id) if spec.adapter is not None else None
        if spec.adapter is not None and lora is None:
            raise RuntimeError(f"adapter {spec.adapter.name} is not loaded in the engine")
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError

        # Already-tokenized ids as a rendered input: vLLM skips its executor hop for tokenization (our
        # validation has checked the ids against the vocabulary), which adds up over a batch's requests.
        try:
            queue = await self._llm.add_request(spec.request_id, tokens_input(list(spec.prompt_token_ids)),
                                                self._params(spec), lora_request=lora)
        except EngineDeadError:
            raise _engine_dead() from None
        return self._events(spec.request_id, queue, spec.sampling.logprobs)

    async def _events(self, request_id: str, queue: Any, top_n: int) -> AsyncIterator[SegmentEvent]:
        from vllm.v1.engine.exceptions import EngineDeadError

        finished = False
        self._live += 1  # counted while consumed, so a generator never started cannot leak a count
        self._peak = max(self._peak, min(self._live, self.settings.max_num_seqs))
        try:
            while not finished:
                try:
                    out = queue.get_nowait() or await queue.get()
                except EngineDeadError:
                    raise _engine_dead() from None
                finished = out.finished
                completion = out.outputs[0]
                token_ids = list(completion.token_ids)
                logprobs, top = _logprobs(token_ids, completion.logprobs, top_n)
                finish = _FINISH.get(completion.finish_reason, Finish.ABORT) if finished else None
                prompt, prompt_top = _prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, top_n)
                routes = await self._routes.take(queue.request_id) if finished and self._routes is not None else None
                yield SegmentEvent(token_ids=token_ids, logprobs=logprobs, top_logprobs=top, finish=finish,
                                   prompt_logprobs=prompt, prompt_top_logprobs=prompt_top, routes=routes)
        finally:
            self._live -= 1
            if not finished and self._llm is not None and not self._llm.errored:  # consumer gone
                await self._llm.abort(queue.request_id, internal=True)  # (vLLM's id for this request)
                if self._routes is not None:
                    self._routes.forget(queue.request_id)
            queue.close()

    async def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids:  # our ids are vLLM's external ids; each gets a final ABORT output
            await self._llm.abort(list(request_ids), internal=False)

    async def pause(self) -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self._llm.resume_generation()

    async def reset_prefix_cache(self) -> None:
        if not await self._llm.reset_prefix_cache():
            logger.info("prefix cache not reset (blocks still in use by running requests)")

    def stats(self) -> EngineStats:
        """Requests in the engine, split as its scheduler would run them (at most max_num_seqs at once)."""
        running = min(self._live, self.settings.max_num_seqs)
        return EngineStats(running, self._live - running, self._peak)

    # ------------------------------------------------------------------- receive in worker

    async def receive_in_worker(self, token: str, manifest: bytes, rendezvous: Mapping[str, Any],
                                key: bytes | None) -> ReceivedTensors:
        """Every worker joins the transfer group with its own rank (``rendezvous["ranks"]``, one per
        worker in worker order) and receives the full version into its own device memory
        (worker_ext.lorarl_receive), to load its own shard from; what comes back is names, dtypes and shapes."""
        ranks = list(rendezvous["ranks"])
        if len(ranks) != self.worker_count:
            raise ValueError(f"{len(ranks)} transfer ranks for an engine of {self.worker_count} workers")
        specs = await self._llm.collective_rpc("lorarl_receive", kwargs={
            "token": token, "manifest": manifest, "key": key, **rendezvous})
        if any(spec != specs[0] for spec in specs[1:]):
            await self.drop_received(token)
            raise RuntimeError("the engine's workers received different tensors for one version")
        logger.info("received %s in %d worker(s), transfer rank(s) %s", token, len(ranks), ranks)
        return ReceivedTensors(token, specs[0])

    async def drop_received(self, token: str) -> None:
        await self._llm.collective_rpc("lorarl_drop_received", kwargs={"token": token})

    # ---------------------------------------------------------------------------- adapters

    async def add_adapter(self, handle: AdapterHandle, lora: LoraSpec, tensors: Mapping[str, torch.Tensor]
                          ) -> None:
        from vllm.lora.request import LoRARequest

        received = received_token(tensors)
        if received is not None:  # already in the worker: register it there, nothing crosses again
            request = LoRARequest(lora_name=handle.name, lora_int_id=handle.lora_int_id,
                                  lora_path=f"{MEMORY_SCHEME}{handle.key}")
            try:
                await self._llm.collective_rpc("lorarl_put_adapter", kwargs={
                    "lora_int_id": handle.lora_int_id, "peft_config": lora.peft_config(), "blob": None,
                    "lora_name": request.lora_name, "lora_path": request.lora_path, "received": received})
            except BaseException:
                await self._forget_adapter(handle)
                await self.drop_received(received)
                raise
            self._lora_requests[handle.lora_int_id] = request
            return
        memory = self._shm_root is None
        path = (f"{MEMORY_SCHEME}{handle.key}" if memory
                else await asyncio.to_thread(self._write_peft_dir, handle, lora, tensors))
        request = LoRARequest(lora_name=handle.name, lora_int_id=handle.lora_int_id, lora_path=path)
        try:
            if memory:  # registered and added by the worker in one engine call (see lorarl_put_adapter)
                blob = await asyncio.to_thread(
                    lambda: next(iter(safetensors_blobs(tensors.items(), max_bytes=1 << 62))))
                await self._llm.collective_rpc("lorarl_put_adapter", kwargs={
                    "lora_int_id": handle.lora_int_id, "peft_config": lora.peft_config(), "blob": blob,
                    "lora_name": request.lora_name, "lora_path": request.lora_path})
            else:
                await self._llm.add_lora(request)
        except BaseException:
            await self._forget_adapter(handle)
            raise
        self._lora_requests[handle.lora_int_id] = request

    def _write_peft_dir(self, handle: AdapterHandle, lora: LoraSpec, tensors: Mapping[str, torch.Tensor]) -> str:
        assert self._shm_root is not None
        # clones: received tensors may be views of one buffer, which safetensors refuses to write as shared memory
        clones = {n: t.detach().contiguous().clone() for n, t in tensors.items()}
        return str(write_peft_files(self._shm_root / handle.key, clones, lora.peft_config()))

    async def remove_adapter(self, handle: AdapterHandle) -> None:
        self._lora_requests.pop(handle.lora_int_id, None)
        await self._llm.remove_lora(handle.lora_int_id)
        await self._forget_adapter(handle)

    async def _forget_adapter(self, handle: AdapterHandle) -> None:
        if self._shm_root is not None:
            shutil.rmtree(self._shm_root / handle.key, ignore_errors=True)
        else:
            await self._llm.collective_rpc("lorarl_drop_adapter", kwargs={"lora_int_id": handle.lora_int_id})

    # ----------------------------------------------------------------------------- weights

    async def stage_weights(self, token: str, weights: Iterable[tuple[str, torch.Tensor]],
                            received: str | None = None) -> None:
        """Stages merged weights for load_weights; ``received``: those of them the worker received itself
        (meta tensors here, skipped), adopted from its receive buffers."""
        if self.merged_refusal:
            raise FailedPreconditionError(f"this rollout cannot reload merged weights: {self.merged_refusal}")
        blobs = iter(safetensors_blobs((n, t) for n, t in weights if not t.is_meta))
        try:
            if received is not None:
                await self._llm.collective_rpc("lorarl_adopt_received", kwargs={"token": token, "received": received})
            while (blob := await asyncio.to_thread(next, blobs, None)) is not None:
                await self._llm.collective_rpc("lorarl_put_weights", kwargs={"token": token, "blob": blob})
        except BaseException:
            await self.drop_weights(token)
            if received is not None:
                await self.drop_received(received)
            raise

    async def drop_weights(self, token: str) -> None:
        await self._llm.collective_rpc("lorarl_drop_weights", kwargs={"token": token})

    async def load_weights(self, token: str, label: str) -> None:
        await self._llm.collective_rpc("lorarl_load_weights", kwargs={"token": token})
        self.weight_version = label  # ours, whether or not this vLLM keeps one (compat.set_weight_version)
        await compat.set_weight_version(self._llm, label)


def _top(entry: Any, top_n: int) -> dict[int, float]:
    """The top-n alternatives of one position's vLLM logprobs (which also hold the chosen token, ranked)."""
    return {int(t): float(lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n}


def _logprobs(token_ids: list[int], entries: Any, top_n: int) -> tuple[list[float], list[dict[int, float]]]:
    """The sampled tokens' logprobs and, when asked for, the top-n alternatives at each position."""
    if not entries:
        return [float("nan")] * len(token_ids), []
    sampled = [float(entry[tok].logprob) for tok, entry in zip(token_ids, entries, strict=True)]
    if top_n <= 0:
        return sampled, []
    return sampled, [_top(entry, top_n) for entry in entries]


def _prompt_logprobs(prompt_ids: Any, entries: Any, top_n: int) -> tuple[list[float] | None, list[dict[int, float]]]:
    """vLLM's prompt logprobs (None first: nothing predicts it) as one float per prompt token, NaN first, and
    with ``top_n`` > 0 the top alternatives at each prompt position (the first empty)."""
    if not entries:
        return None, []
    sampled = [float("nan") if entry is None else float(entry[tok].logprob)
               for tok, entry in zip(prompt_ids, entries, strict=True)]
    return sampled, [{} if entry is None else _top(entry, top_n) for entry in entries] if top_n > 0 else []


def _engine_dead() -> UnavailableError:
    """What a request that met a dead engine core answers: this replica restarts (see wait_dead)."""
    return UnavailableError("vLLM's engine core died; this rollout replica is stopping to be restarted")
