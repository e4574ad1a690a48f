"""The LoRA spec: one type from the job file to vLLM, with its defaults, scale, targets, PEFT config and
proto form in one place.

The trainer trains by it, the weight-sync service keeps it beside a job's catalog and merges by it, the
rollout serves by it, and the client writes it: each reads the same fields with the same meaning, and no
other module converts between forms. A proto zero means "unset" here (rank 0 -> DEFAULT_RANK, alpha 0 ->
2 x rank, no target modules -> "all-linear"), the rule `from_proto` applies once.

    y = x W^T + scale * dropout(x) A^T B^T,   scale = alpha / r   (rsLoRA: alpha / sqrt(r))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from lorarl.contract.errors import SpecError
from lorarl.v1 import common_pb2

ALL_LINEAR = "all-linear"
#: Attention-only and MLP-only adapters (the Tinker API's train_attn / train_mlp): with both, "all-linear".
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
DENSE_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
#: Never adapted by "all-linear" (PEFT excludes the output layer; embeddings are not linears).
NOT_LINEAR = frozenset({"lm_head", "embed_tokens"})
#: Qwen3.5 / Qwen3.6 Gated DeltaNet (linear-attention) projections; vLLM serves LoRA on all five
#: (packed as in_proj_qkvz = [in_proj_qkv, in_proj_z], in_proj_ba = [in_proj_b, in_proj_a], out_proj).
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
#: What "all-linear" adapts: every decoder linear of the supported families (absent names match nothing).
LINEAR_TARGETS = DENSE_TARGETS + LINEAR_ATTENTION_TARGETS
EXPERT_PROJS = MLP_TARGETS
ExpertMode = Literal["none", "per_expert", "shared"]

#: The defaults of every entry point (job file, gRPC JobConfig, Python API): rank 16, alpha twice the rank.
DEFAULT_RANK = 16
ALPHA_PER_RANK = 2.0
#: The ranks vLLM's engines take for max_lora_rank (vllm.config.lora.MaxLoRARanks); the largest bounds a spec.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_RANK = VLLM_LORA_RANKS[-1]
MAX_TARGETS = 64

EXPERT_MODE_NAMES: dict[int, ExpertMode] = {
    common_pb2.EXPERT_ADAPTER_MODE_UNSPECIFIED: "per_expert",
    common_pb2.EXPERT_ADAPTER_MODE_NONE: "none",
    common_pb2.EXPERT_ADAPTER_MODE_PER_EXPERT: "per_expert",
    common_pb2.EXPERT_ADAPTER_MODE_SHARED: "shared",
}
EXPERT_MODE_ENUMS: dict[str, int] = {"none": common_pb2.EXPERT_ADAPTER_MODE_NONE,
                                     "per_expert": common_pb2.EXPERT_ADAPTER_MODE_PER_EXPERT,
                                     "shared": common_pb2.EXPERT_ADAPTER_MODE_SHARED}


def serving_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that serves an adapter of ``rank`` (a rollout's default)."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def default_alpha(rank: int) -> float:
    return ALPHA_PER_RANK * rank


def lora_scale(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA: the factor on B @ A everywhere (train, merge, serve)."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter is: its rank, alpha and targets (a received adapter may name the modules its tensors
    really adapt; ``()`` means every linear), plus how a trainer trains it (dropout, expert mode).

    Field order keeps the first three positional (rank, alpha, target_modules), as adapters are described.
    """

    rank: int = DEFAULT_RANK
    alpha: float = ALPHA_PER_RANK * DEFAULT_RANK
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    dropout: float = 0.0
    expert_mode: ExpertMode = "per_expert"
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise SpecError("lora", "rank", f"must be in 1..{MAX_RANK}, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise SpecError("lora", "alpha", f"must be a finite number > 0, got {self.alpha}")
        if len(self.target_modules) > MAX_TARGETS or any(len(t) > 128 for t in self.target_modules):
            raise SpecError("lora", "target_modules", f"at most {MAX_TARGETS} names of at most 128 characters")
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError("lora", "dropout", f"must be in [0, 1), got {self.dropout}")
        if self.expert_mode not in EXPERT_MODE_ENUMS:
            raise SpecError("lora", "expert_mode", f"must be none, per_expert or shared, got {self.expert_mode!r}")

    @property
    def scale(self) -> float:
        return lora_scale(self.rank, self.alpha, self.use_rslora)

    def targets(self) -> frozenset[str]:
        """The module names adapted: "all-linear" (or none named) resolves to every supported linear."""
        if not self.target_modules or ALL_LINEAR in self.target_modules:
            return frozenset(LINEAR_TARGETS)
        return frozenset(self.target_modules)

    def check_trainable(self) -> LoraSpec:
        """The spec as a trainer must receive it: known target names, vLLM-servable combinations."""
        unknown = set(self.target_modules) - {ALL_LINEAR, *LINEAR_TARGETS}
        if unknown:
            raise SpecError("lora", "target_modules", f"has unknown names {sorted(unknown)}; "
                            f"use {ALL_LINEAR!r} or names from {list(LINEAR_TARGETS)}")
        if "in_proj_z" in self.target_modules and "in_proj_qkv" not in self.target_modules:
            # vLLM packs them as in_proj_qkvz and cannot load an adapter with in_proj_z alone.
            raise SpecError("lora", "target_modules", "in_proj_z needs in_proj_qkv too (vLLM serves them packed)")
        return self

    def peft_config(self, base_model_name_or_path: str = "", target_modules: list[str] | None = None
                    ) -> dict[str, Any]:
        """adapter_config.json as PEFT writes it (the fields PEFT and vLLM's PEFTHelper read), naming the
        modules the tensors adapt (``target_modules``; default: this spec's own). ``base_model_name_or_path``:
        where PEFT loads the base from, a Hub id or a path (a trainer's: TrainingSpec.base_model_name_or_path)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "use_rslora": self.use_rslora,
            "target_modules": sorted(self.target_modules) if target_modules is None else target_modules,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "modules_to_save": None,
            "init_lora_weights": True,
        }

    def warm_start_problems(self, config: dict[str, Any]) -> list[str]:
        """Why a PEFT adapter_config.json cannot start a job trained by this spec (empty: it can). Each line
        names the PEFT field, and the job key to change where one would fix it."""
        problems = []
        kinds = {"r": int, "lora_alpha": (int, float), "use_rslora": bool, "target_modules": (list, str, type(None))}
        for field, kind in kinds.items():
            if field in config and (not isinstance(config[field], kind) or (isinstance(config[field], bool)
                                    and kind is not bool)):
                problems.append(f"{field} is {config[field]!r}: not a valid value")
        if problems:
            return problems
        if config.get("peft_type", "LORA") != "LORA":
            problems.append(f"peft_type is {config.get('peft_type')!r}; only LORA adapters can start a job")
        unsupported = {"use_dora": "DoRA", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
                       "modules_to_save": "fully trained extra modules", "layers_to_transform": "a layer subset",
                       "use_qalora": "QA-LoRA", "lora_bias": "LoRA biases", "trainable_token_indices": "trained tokens"}
        for field, what in unsupported.items():
            value = config.get(field)
            if value is not None and value is not False and not (isinstance(value, list | dict | str) and not value):
                problems.append(f"{field} is set ({what}): not supported by lorarl's LoRA layers")
        if config.get("bias", "none") != "none":
            problems.append(f"bias is {config['bias']!r} (trained biases): not supported; use 'none'")
        if config.get("fan_in_fan_out"):
            problems.append("fan_in_fan_out is true (Conv1D weights): not a Qwen3 adapter")
        for field, key, want, have in (("r", "trainer.lora.rank", self.rank, config.get("r")),
                                       ("lora_alpha", "trainer.lora.alpha", self.alpha, config.get("lora_alpha")),
                                       ("use_rslora", "trainer.lora.use_rslora", self.use_rslora,
                                        bool(config.get("use_rslora", False)))):
            if have is None or (float(have) != float(want) if field != "use_rslora" else have != want):
                problems.append(f"{field} is {have!r} but the job's {key} is {want!r}: set {key}: {have}")
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            targets = [ALL_LINEAR] if targets == ALL_LINEAR else [targets]
        unknown = sorted(set(targets) - {ALL_LINEAR, *LINEAR_TARGETS})
        if unknown:
            problems.append(f"target_modules names {unknown}, which lorarl does not adapt")
        elif ALL_LINEAR not in self.target_modules and not set(targets) <= self.targets():
            problems.append(f"target_modules {sorted(targets)} are not all among the job's trainer.lora.target_modules "
                            f"{sorted(self.target_modules)}")
        elif ALL_LINEAR in self.target_modules and ALL_LINEAR not in targets and not set(DENSE_TARGETS) <= set(targets):
            problems.append(f"target_modules {sorted(targets)} adapt fewer modules than the job's all-linear: set "
                            f"trainer.lora.target_modules: {sorted(targets)}")
        return problems

    @classmethod
    def from_peft_config(cls, config: dict[str, Any]) -> LoraSpec:
        """The spec of a PEFT adapter_config.json (rank, alpha, targets, rsLoRA)."""
        targets = config.get("target_modules") or ()
        return cls(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                   target_modules=(targets,) if isinstance(targets, str) else tuple(targets),  # PEFT: "all-linear"
                   use_rslora=bool(config.get("use_rslora", False)))

    def to_proto(self) -> common_pb2.LoraSpec:
        return common_pb2.LoraSpec(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                                   target_modules=list(self.target_modules),
                                   expert_mode=EXPERT_MODE_ENUMS[self.expert_mode], use_rslora=self.use_rslora)

    @classmethod
    def from_proto(cls, spec: common_pb2.LoraSpec) -> LoraSpec:
        """The spec a proto carries, zeros read as unset (see the module docstring); ValueError says what is
        wrong (a subclass's own checks included: the trainer's LoraConfig checks its targets)."""
        if spec.expert_mode not in EXPERT_MODE_NAMES:
            raise SpecError("lora", "expert_mode", f"unknown value {spec.expert_mode}")
        rank = spec.rank or DEFAULT_RANK
        return cls(rank=rank, alpha=spec.alpha or default_alpha(rank),
                   target_modules=tuple(spec.target_modules) or (ALL_LINEAR,), dropout=spec.dropout,
                   expert_mode=EXPERT_MODE_NAMES[spec.expert_mode], use_rslora=spec.use_rslora)
