"""Every redirection that lets megatron-core 0.16 run on CPU, in one place.

megatron-core assumes CUDA: it allocates with ``device=torch.cuda.current_device()``, builds the
default causal mask with ``device="cuda"`` and keeps its dropout/init RNG streams as CUDA generator
states. On a CPU-only torch each of these raises. `enable()` patches exactly those, and only in
a process where CUDA is unavailable, so every patched call could only have raised before; GPU jobs
never call it; `disable()` restores everything. What this buys on megatron-core 0.16.1 with gloo
(tested here): a GPTModel with the local (non Transformer-Engine) spec builds and runs forward and
backward under TP and EP, and forward and backward through the 1F1B pipeline schedule under PP. Reported earlier but
not tested here: DDP and megatron's optimizer step run; the distributed optimizer and
clip_grad > 0 do not (CUDA-only multi-tensor kernels).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

_saved: list[tuple[object, str, object]] = []  # (owner, attribute, original value), in patch order


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's named RNG streams (data-parallel, tensor-parallel, expert) on the CPU generator.

        A subclass, so megatron's isinstance checks still see its tracker; `add` and `fork` swap the
        CPU generator state instead of the CUDA one.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def patch_missing_transformer_engine() -> None:
    """Defines ``moe_utils.te_general_gemm = None`` when Transformer Engine is absent; idempotent, any device.

    megatron-core 0.16.1 imports ``te_general_gemm`` only inside ``try: import transformer_engine``
    but the MoE router's gating GEMM tests ``te_general_gemm is not None`` unconditionally, so every
    MoE forward without TE raises NameError; None selects its plain torch.mm path.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _host_tensor_cuda(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return self


def _tied_embedding_setup_on_host(setup: Callable[..., None]) -> Callable[..., None]:
    """Wraps LanguageModule.setup_embeddings_and_output_layer so its ``.cuda()`` keeps tensors on the host."""

    @functools.wraps(setup)
    def wrapper(self: object, *args: object, **kwargs: object) -> None:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = _host_tensor_cuda
        try:
            setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapper


class _HostTorch:
    """``torch`` as seen by one megatron module, with ``device="cuda"`` in zeros() read as the host."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: object, device: object = None, **kwargs: object) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def enable() -> None:
    """Patches megatron-core for CPU in this process; idempotent. Call before building a model.

    1. ``torch.cuda.current_device`` -> ``torch.device("cpu")``: parameters, rotary frequencies,
       all-gather buffers (tensor_parallel.mappings/layers/utils), router tensors and the logits
       buffer are allocated on it.
    2. ``fused_softmax.get_default_causal_mask`` -> a CPU mask: attention with ``attention_mask=None``
       builds the causal mask with a literal ``device="cuda"``.
    3. megatron's RNG tracker -> `CpuRNGStatesTracker`: ``get_cuda_rng_tracker().fork()`` (around
       weight init and dropout) and ``model_parallel_cuda_manual_seed`` save/restore CUDA generator
       states.
    4. ``LanguageModule.setup_embeddings_and_output_layer`` runs with ``Tensor.cuda`` as identity:
       with pp > 1 and tied embeddings it moves the last stage's embedding copy ``.cuda()`` before
       all-reducing it from the first stage (only during that call, nothing else sees the change).
    5. ``pipeline_parallel.schedules`` sees `_HostTorch` as ``torch``: every forward/backward
       schedule (pp == 1 included) counts tokens in ``torch.zeros([], device="cuda")``.
    6. `patch_missing_transformer_engine` (also applied on GPUs without TE).
    """
    patch_missing_transformer_engine()
    if _saved:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron CPU mode needs a process without CUDA (it patches torch.cuda.current_device); "
                           "run GPU jobs with device='cuda'")
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    _set(torch.cuda, "current_device", _cpu_current_device)
    _set(fused_softmax, "get_default_causal_mask", _cpu_causal_mask)
    _set(mrandom, "_CUDA_RNG_STATE_TRACKER", _cpu_tracker_class()())
    _set(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _set(schedules, "torch", _HostTorch())
    _set(LanguageModule, "setup_embeddings_and_output_layer",
         _tied_embedding_setup_on_host(LanguageModule.setup_embeddings_and_output_layer))


def _set(owner: object, name: str, value: object) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def disable() -> None:
    """Undoes `enable` (not the TE fix), so a test process leaves torch and megatron as it found them."""
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)


def enabled() -> bool:
    return bool(_saved)
