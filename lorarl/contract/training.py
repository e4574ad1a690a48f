"""The training spec: what a job trains by — loss, optimizer, memory, parallel sizes, limits — with its
defaults, bounds and proto form in one place, as lorarl.contract.lora is for the adapter.

The job file's `trainer.loss` / `trainer.optimizer` / `trainer.memory` sections are these classes, the SDK
and every other client send them with `to_proto`, and the trainer reads them with `from_proto`: a default or
a bound changes here and nowhere else. A bad value raises `SpecError` naming its field, which each surface
puts under its own path (`trainer.optimizer.learning_rate` in a job file, `config.optimizer.learning_rate`
over gRPC).

Proto3 scalars have no presence, so on the wire a zero means "unset, the default" wherever zero is not a
meaningful setting (learning rate, clip ranges, betas, eps, limits); where unset must differ from zero the
field is `optional` and read by presence (`max_grad_norm`, `loss.max_staleness`,
`loss.behavior_weight_cap`, `memory.logits_chunk_tokens`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from lorarl.contract.enums import KL_ESTIMATORS, KL_NAMES, LOSS_NAMES, LOSS_TYPES
from lorarl.contract.errors import SpecError
from lorarl.contract.fields import setting
from lorarl.contract.lora import LoraSpec
from lorarl.v1 import trainer_pb2

LossName = Literal["grpo", "dr_grpo", "dapo", "rloo", "gspo", "ppo", "cross_entropy", "importance_sampling",
                   "token_ppo", "token_cispo", "opd"]
#: The losses that take the caller's per-token advantages (a trajectory's ``token_advantages``; for
#: cross_entropy, the tokens' weights) and sum over tokens, as the Tinker API defines cross_entropy,
#: importance_sampling, ppo and cispo (here token_ppo, token_cispo): no group rule, no normalisation, no
#: decoupled-PPO weights.
TOKEN_LOSSES = ("cross_entropy", "importance_sampling", "token_ppo", "token_cispo")
#: What a token loss leaves to the caller, so these settings are refused with it rather than ignored.
_NOT_WITH_TOKEN_LOSSES = ("dual_clip", "kl_coef", "behavior_weight_cap", "max_staleness", "overlong_buffer",
                          "overlong_penalty", "entropy_coef", "rollout_correction", "distill_weight", "rl_weight")
KlName = Literal["k1", "k2", "k3"]
RolloutIsLevel = Literal["token", "sequence"]
RolloutRejection = Literal["token", "sequence", "geometric", "k3"]
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_REJECTIONS = ("token", "sequence", "geometric", "k3")
#: Truncated IS's cap C (verl's ``rollout_is_threshold`` default, SkyRL's token-TIS clip).
ROLLOUT_IS_THRESHOLD = 2.0
#: Each rejection mode's (low, high) bounds when none is given: verl's presets (Seq-MIS "0.5_2.0", Geo-RS
#: "0.999_1.001", K3-RS 0.01 above only); token rejection keeps IcePop's symmetric [0.5, 2].
ROLLOUT_RS_BOUNDS: dict[str, tuple[float | None, float]] = {
    "token": (0.5, 2.0), "sequence": (0.5, 2.0), "geometric": (0.999, 1.001), "k3": (None, 0.01)}
Checkpointing = Literal["auto", "on", "off"]
RoutingReplay = Literal["auto", "on", "off"]
ROUTING_REPLAY = ("auto", "on", "off")
FingerprintCheck = Literal["refuse", "flag", "off"]
FINGERPRINT_CHECKS = ("refuse", "flag", "off")
Engine = Literal["torch", "megatron"]
Dtype = Literal["float32", "bfloat16"]
DTYPES = ("float32", "bfloat16")
ENGINES = ("torch", "megatron")
CHECKPOINTING = ("auto", "on", "off")

#: Adam's learning rate when none is given: the Tinker API's default, in the range LoRA RL uses (LoRA wants
#: ~10x a full fine-tune's rate); the shipped tiny-model examples set their own, larger one.
DEFAULT_LEARNING_RATE = 1e-4
CLIP_EPS = 0.2
#: DAPO's "clip-higher" upper range (arXiv 2503.14476), the default upper clip of loss type dapo.
DAPO_CLIP_EPS_HIGH = 0.28
#: Decoupled PPO's cap on behaviour importance weights when tokens may be stale (``max_staleness`` set) and
#: no cap is given: AReaL's choice. Without staleness the loss is on-policy and nothing is capped.
STALE_WEIGHT_CAP = 5.0
#: Rows of one LM-head/log-softmax chunk: 1024 x 151,936 fp32 is 0.6 GiB per [tokens, vocab] tensor.
DEFAULT_LOGITS_CHUNK_TOKENS = 1024
#: Prompt + completion tokens a job accepts by default, and trajectories it buffers between steps.
DEFAULT_MAX_SEQUENCE_TOKENS = 4096
DEFAULT_MAX_BUFFERED_TRAJECTORIES = 4096
#: Model-parallel sizes past this are typos, not plans.
MAX_PARALLEL = 1024
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|npu(:\d+)?")


def _finite(section: str, obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not math.isfinite(value):
            raise SpecError(section, name, f"must be a finite number, got {value}")


def _at_least(section: str, obj: object, names: tuple[str, ...], low: float, note: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            raise SpecError(section, name, f"must be >= {low}{note}, got {value}")


@dataclass(frozen=True)
class CorrectionSpec:
    """Rollout correction: what still differs between the rollout that sampled a token (mu) and the trainer's
    own policy before the step (pi_old), corrected per token or per sequence (lorarl.trainer.rl.correction).

    Every rule reads rho_t = pi_old(y_t) / mu(y_t) (log rho clamped to [-20, 20]), detached:
    importance weights (``rollout_is``) multiply a token's loss term; rejection (``rollout_rs``) removes
    tokens or whole sequences from the loss *and* its denominator. Names and defaults follow verl's
    ``algorithm.rollout_correction`` (its presets: token TIS = ``rollout_is: token``; Seq-MIS =
    ``rollout_is: sequence`` + ``rollout_rs: sequence``; Geo-RS = ``rollout_rs: geometric``; K3-RS =
    ``rollout_rs: k3``; IcePop = ``rollout_is: token`` + ``rollout_is_threshold_low``). Any rule turns on
    decoupled PPO: the trainer recomputes pi_old before the step.
    """

    rollout_is: RolloutIsLevel | None = setting(
        None, doc="Truncated importance weights: 'token' w_t = min(rho_t, C); 'sequence' w = min(prod_t rho_t, C) "
                  "for every token of the sequence; null: none.")
    rollout_is_threshold: float = setting(ROLLOUT_IS_THRESHOLD, doc="C, the cap of the importance weights (> 1).")
    rollout_is_threshold_low: float | None = setting(
        None, doc="IcePop: a weight (token or sequence) outside [low, C] is 0 instead of truncated (the token stays in "
                  "the denominator); null: truncation only.")
    rollout_rs: RolloutRejection | None = setting(
        None, doc="Rejection: 'token' drops tokens with rho_t outside [low, high]; 'sequence' drops sequences "
                  "whose prod_t rho_t is outside (Seq-MIS); 'geometric' drops sequences whose exp(mean_t log rho_t) "
                  "is outside (Geo-RS); 'k3' drops sequences whose mean_t (rho_t - 1 - log rho_t) is above high; "
                  "null: none.")
    rollout_rs_threshold: float | None = setting(
        None, doc="The rejection's upper bound (null: token 2, sequence 2, geometric 1.001, k3 0.01).")
    rollout_rs_threshold_low: float | None = setting(
        None, doc="The rejection's lower bound (null: token 0.5, sequence 0.5, geometric 0.999; k3 has none).")

    def __post_init__(self) -> None:
        s = "loss.rollout_correction"
        _finite(s, self, ("rollout_is_threshold", "rollout_is_threshold_low", "rollout_rs_threshold",
                          "rollout_rs_threshold_low"))
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise SpecError(s, "rollout_is", f"must be one of {list(ROLLOUT_IS_LEVELS)} or null, "
                                             f"got {self.rollout_is!r}")
        if self.rollout_rs is not None and self.rollout_rs not in ROLLOUT_REJECTIONS:
            raise SpecError(s, "rollout_rs", f"must be one of {list(ROLLOUT_REJECTIONS)} or null, "
                                             f"got {self.rollout_rs!r}")
        if not self.rollout_is_threshold > 1.0:
            raise SpecError(s, "rollout_is_threshold", f"must be > 1, got {self.rollout_is_threshold}")
        low = self.rollout_is_threshold_low
        if low is not None and not 0.0 <= low < 1.0:
            raise SpecError(s, "rollout_is_threshold_low", f"must be in [0, 1), got {low}")
        if low is not None and self.rollout_is is None:
            raise SpecError(s, "rollout_is_threshold_low", "needs rollout_is (token or sequence)")
        given = (self.rollout_rs_threshold, self.rollout_rs_threshold_low)
        if self.rollout_rs is None:
            if any(v is not None for v in given):
                raise SpecError(s, "rollout_rs_threshold" if given[0] is not None else "rollout_rs_threshold_low",
                                "needs rollout_rs (token, sequence, geometric or k3)")
            return
        if self.rollout_rs == "k3" and self.rollout_rs_threshold_low is not None:
            raise SpecError(s, "rollout_rs_threshold_low", "has no meaning with rollout_rs k3 (a KL estimate has an "
                                                           "upper bound only)")
        rs_low, rs_high = self.rs_bounds
        if not rs_high > 0:
            raise SpecError(s, "rollout_rs_threshold", f"must be > 0, got {rs_high}")
        if rs_low is not None and not 0.0 <= rs_low < rs_high:
            raise SpecError(s, "rollout_rs_threshold_low", f"must be in [0, rollout_rs_threshold = {rs_high}), "
                                                           f"got {rs_low}")

    @property
    def active(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def rs_bounds(self) -> tuple[float | None, float]:
        """The rejection's (low, high): the given ones, else the mode's defaults (ROLLOUT_RS_BOUNDS)."""
        low, high = ROLLOUT_RS_BOUNDS[self.rollout_rs or "token"]
        if self.rollout_rs_threshold is not None:
            high = self.rollout_rs_threshold
        if self.rollout_rs_threshold_low is not None:
            low = self.rollout_rs_threshold_low
        return low, high

    def to_proto(self) -> trainer_pb2.RolloutCorrection:
        return trainer_pb2.RolloutCorrection(
            rollout_is=self.rollout_is or "", rollout_is_threshold=self.rollout_is_threshold,
            rollout_is_threshold_low=self.rollout_is_threshold_low, rollout_rs=self.rollout_rs or "",
            rollout_rs_threshold=self.rollout_rs_threshold, rollout_rs_threshold_low=self.rollout_rs_threshold_low)

    @classmethod
    def from_proto(cls, cfg: trainer_pb2.RolloutCorrection) -> CorrectionSpec:
        def present(name: str) -> float | None:
            return getattr(cfg, name) if cfg.HasField(name) else None

        return cls(rollout_is=cfg.rollout_is or None,  # type: ignore[arg-type]  # checked in __post_init__
                   rollout_is_threshold=present("rollout_is_threshold") or ROLLOUT_IS_THRESHOLD,
                   rollout_is_threshold_low=present("rollout_is_threshold_low"),
                   rollout_rs=cfg.rollout_rs or None,  # type: ignore[arg-type]
                   rollout_rs_threshold=present("rollout_rs_threshold"),
                   rollout_rs_threshold_low=present("rollout_rs_threshold_low"))


@dataclass(frozen=True)
class LossSpec:
    """The policy loss (lorarl.trainer.rl.losses computes it)."""

    type: LossName = setting("grpo", doc="grpo, dr_grpo, dapo, rloo, gspo or ppo (advantages from rewards by "
                                         "group); cross_entropy, importance_sampling, token_ppo or token_cispo "
                                         "(the caller's "
                                         "per-token advantages, summed over tokens); opd (on-policy "
                                         "distillation: each token's advantage the reverse KL to its teacher).")
    clip_eps_low: float = setting(CLIP_EPS, doc="PPO clip range below 1, in [0, 1).")
    clip_eps_high: float | None = setting(None, doc=f"Clip range above 1 (null: {DAPO_CLIP_EPS_HIGH} for dapo's "
                                                    f"clip-higher, else {CLIP_EPS}).")
    dual_clip: float = setting(0.0, doc="Dual-clip constant c > 1 (0: off).")
    kl_coef: float = setting(0.0, doc="Weight of the KL to the base model (0: off).")
    kl_estimator: KlName = setting("k3", doc="k1, k2 or k3.")
    behavior_weight_cap: float | None = setting(
        None, doc=f"Decoupled PPO: cap on behaviour importance weights (null: {STALE_WEIGHT_CAP} when tokens may be "
                  "stale, i.e. max_staleness is set, as in an async loop; else off; 0: off).")
    max_staleness: int | None = setting(
        None, doc="Mask tokens produced more than this many versions ago (0: all but the current version's; "
                  "null: none; a job file's async loop sets loop.max_staleness here).")
    overlong_buffer: int = setting(0, doc="DAPO overlong penalty: tokens before max_response_tokens it ramps over.")
    overlong_penalty: float = setting(0.0, doc="DAPO overlong penalty at max_response_tokens.")
    max_response_tokens: int = setting(0, doc="Length the overlong penalty is measured against (a job file: "
                                              "rollout.max_tokens).")
    entropy_coef: float = setting(0.0, doc="Entropy bonus weight.")
    rollout_correction: CorrectionSpec = setting(
        default_factory=CorrectionSpec, doc="Rollout correction: importance weights and rejection from the "
                                            "rollout's logprobs vs the trainer's (off by default).")
    distill_weight: float | None = setting(
        None, doc="Weight of the per-token reverse KL to the teachers in each token's advantage, "
                  "-(log pi_old - log pi_teacher) (null: 1 for opd, else 0; needs teachers).")
    rl_weight: float | None = setting(
        None, doc="Weight of the reward's group advantage (null: 0 for opd, else 1).")

    def __post_init__(self) -> None:
        s = "loss"
        if self.type not in LOSS_TYPES:
            raise SpecError(s, "type", f"must be one of {list(LOSS_TYPES)}, got {self.type!r}")
        _finite(s, self, ("clip_eps_low", "clip_eps_high", "dual_clip", "kl_coef", "behavior_weight_cap",
                          "overlong_penalty", "entropy_coef"))
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise SpecError(s, "clip_eps_low", f"must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high is not None and not 0.0 <= self.clip_eps_high <= 10.0:
            raise SpecError(s, "clip_eps_high", f"must be in [0, 10], got {self.clip_eps_high}")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise SpecError(s, "dual_clip", f"must be > 1 (or 0 to disable), got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise SpecError(s, "kl_estimator", f"must be k1, k2 or k3, got {self.kl_estimator!r}")
        _finite(s, self, ("distill_weight", "rl_weight"))
        _at_least(s, self, ("kl_coef", "behavior_weight_cap", "max_staleness", "overlong_buffer",
                            "overlong_penalty", "max_response_tokens", "distill_weight", "rl_weight"), 0)
        if not self.takes_token_advantages and not (self.distill_scale or self.reward_scale):
            raise SpecError(s, "rl_weight", "and distill_weight are both 0: nothing would be learned")
        if self.overlong_buffer and not self.max_response_tokens:
            raise SpecError(s, "overlong_buffer", "needs loss.max_response_tokens")
        if self.rollout_correction.rollout_is and self.behavior_weight_cap:
            raise SpecError(s, "behavior_weight_cap", "must be unset (or 0) with rollout_correction.rollout_is, whose "
                                                      "weights replace decoupled PPO's capped token weights")
        if self.takes_token_advantages:
            for name in _NOT_WITH_TOKEN_LOSSES:
                value = getattr(self, name)
                if name == "rollout_correction":
                    value = value.active
                if (value is not None) if name == "max_staleness" else bool(value):
                    raise SpecError(s, name, f"must be unset with loss type {self.type}: its advantages are the "
                                             "caller's, per token (fold penalties and corrections into them)")

    @property
    def distill_scale(self) -> float:
        """The reverse KL's weight in each token's advantage: the given one, else 1 for opd and 0 otherwise."""
        return self.distill_weight if self.distill_weight is not None else float(self.type == "opd")

    @property
    def reward_scale(self) -> float:
        """The reward's group advantage's weight: the given one, else 0 for opd and 1 otherwise."""
        return self.rl_weight if self.rl_weight is not None else float(self.type != "opd")

    @property
    def distills(self) -> bool:
        """Whether each trajectory needs its teacher's logprobs (teacher_logprobs)."""
        return self.distill_scale > 0

    @property
    def takes_token_advantages(self) -> bool:
        """Whether this loss reads the caller's per-token advantages (and no reward, no group)."""
        return self.type in TOKEN_LOSSES

    @property
    def upper_clip(self) -> float:
        """The clip range above 1 the loss applies: the given one, else the loss type's default."""
        if self.clip_eps_high is not None:
            return self.clip_eps_high
        return DAPO_CLIP_EPS_HIGH if self.type == "dapo" else CLIP_EPS

    @property
    def weight_cap(self) -> float:
        """The behaviour-weight cap the loss applies (0: none): the given one, else the rule above; none where
        ``rollout_correction.rollout_is`` weighs the tokens instead."""
        if self.rollout_correction.rollout_is is not None:
            return 0.0
        if self.behavior_weight_cap is not None:
            return self.behavior_weight_cap
        return STALE_WEIGHT_CAP if self.max_staleness is not None else 0.0

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> LossSpec:
        """The spec ``dataclasses.asdict`` gave (a checkpoint's manifest, a rank command); TypeError on an
        unknown key."""
        correction = fields.get("rollout_correction") or {}
        if not isinstance(correction, dict):
            raise TypeError(f"rollout_correction must be an object, got {type(correction).__name__}")
        return cls(**{**fields, "rollout_correction": CorrectionSpec(**correction)})

    def to_proto(self) -> trainer_pb2.LossConfig:
        return trainer_pb2.LossConfig(
            type=LOSS_TYPES[self.type], clip_eps_low=self.clip_eps_low, clip_eps_high=self.upper_clip,
            dual_clip=self.dual_clip, kl_coef=self.kl_coef, kl_estimator=KL_ESTIMATORS[self.kl_estimator],
            behavior_weight_cap=self.behavior_weight_cap, max_staleness=self.max_staleness,
            overlong_buffer=self.overlong_buffer, overlong_penalty=self.overlong_penalty,
            max_response_tokens=self.max_response_tokens, entropy_coef=self.entropy_coef,
            rollout_correction=self.rollout_correction.to_proto(), distill_weight=self.distill_weight,
            rl_weight=self.rl_weight)

    @classmethod
    def from_proto(cls, cfg: trainer_pb2.LossConfig) -> LossSpec:
        if cfg.type not in LOSS_NAMES:
            raise SpecError("loss", "type", f"unknown loss type {cfg.type}")
        if cfg.kl_estimator not in KL_NAMES:
            raise SpecError("loss", "kl_estimator", f"unknown estimator {cfg.kl_estimator}")
        return cls(type=LOSS_NAMES[cfg.type], clip_eps_low=cfg.clip_eps_low or CLIP_EPS,
                   clip_eps_high=cfg.clip_eps_high or None, dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef,
                   kl_estimator=KL_NAMES[cfg.kl_estimator],
                   behavior_weight_cap=cfg.behavior_weight_cap if cfg.HasField("behavior_weight_cap") else None,
                   max_staleness=cfg.max_staleness if cfg.HasField("max_staleness") else None,
                   overlong_buffer=cfg.overlong_buffer, overlong_penalty=cfg.overlong_penalty,
                   max_response_tokens=cfg.max_response_tokens, entropy_coef=cfg.entropy_coef,
                   rollout_correction=CorrectionSpec.from_proto(cfg.rollout_correction),
                   distill_weight=cfg.distill_weight if cfg.HasField("distill_weight") else None,
                   rl_weight=cfg.rl_weight if cfg.HasField("rl_weight") else None)


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW and its schedule: linear warmup over ``warmup_steps``, then cosine decay to 0 at ``total_steps``
    when ``total_steps > warmup_steps``, constant otherwise (RL jobs often run open-ended)."""

    learning_rate: float = setting(DEFAULT_LEARNING_RATE, doc="Adam's learning rate, in (0, 10].")
    weight_decay: float = setting(0.0, doc="AdamW weight decay (of this job's adapter only).")
    beta1: float = setting(0.9, doc="Adam's first-moment decay, in [0, 1).")
    beta2: float = setting(0.999, doc="Adam's second-moment decay, in [0, 1).")
    eps: float = setting(1e-8, doc="Adam's epsilon, > 0.")
    warmup_steps: int = setting(0, doc="Linear warmup steps.")
    total_steps: int = setting(0, doc="Cosine decay to 0 at this step (0: constant after warmup).")
    max_grad_norm: float = setting(1.0, doc="Gradient clipping norm (0: no clipping; the norm is still reported).")
    micro_batch_tokens: int = setting(0, doc="Token budget of one micro-batch (0: the whole batch at once).")

    def __post_init__(self) -> None:
        s = "optimizer"
        _finite(s, self, ("learning_rate", "weight_decay", "beta1", "beta2", "eps", "max_grad_norm"))
        if not 0 < self.learning_rate <= 10.0:
            raise SpecError(s, "learning_rate", f"must be in (0, 10], got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise SpecError(s, name, f"must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise SpecError(s, "eps", f"must be > 0, got {self.eps}")
        _at_least(s, self, ("weight_decay", "warmup_steps", "total_steps", "micro_batch_tokens"), 0)
        _at_least(s, self, ("max_grad_norm",), 0, " (0 disables)")

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def to_proto(self) -> trainer_pb2.OptimizerConfig:
        return trainer_pb2.OptimizerConfig(
            learning_rate=self.learning_rate, weight_decay=self.weight_decay, beta1=self.beta1, beta2=self.beta2,
            eps=self.eps, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
            max_grad_norm=self.max_grad_norm, micro_batch_tokens=self.micro_batch_tokens)

    @classmethod
    def from_proto(cls, cfg: trainer_pb2.OptimizerConfig) -> OptimizerSpec:
        return cls(learning_rate=cfg.learning_rate or DEFAULT_LEARNING_RATE, weight_decay=cfg.weight_decay,
                   beta1=cfg.beta1 or 0.9, beta2=cfg.beta2 or 0.999, eps=cfg.eps or 1e-8,
                   warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps,
                   max_grad_norm=cfg.max_grad_norm if cfg.HasField("max_grad_norm") else 1.0,
                   micro_batch_tokens=cfg.micro_batch_tokens)


#: The OptimizerSpec fields a caller may set for one optim_step (the Tinker API's AdamParams sends all of them on
#: every step): Adam's betas and eps, the weight decay and the clipping norm. The learning rate goes per step too,
#: as OptimStepRequest.learning_rate (it overrides the schedule).
STEP_OPTIMIZER_FIELDS = ("beta1", "beta2", "eps", "weight_decay", "max_grad_norm")


@dataclass(frozen=True)
class AdamStep:
    """One optim_step's Adam hyperparameters, where the caller sets them (None: the job's OptimizerSpec value).

    The optimizer (its moments, its step count) is the job's; its hyperparameters are the caller's, step by step,
    as Tinker's ``optim_step(AdamParams(...))`` sends them. A step that names none runs with the job's own: an
    override lasts one step. Bounds are OptimizerSpec's (``applied_to`` builds one), so a bad value is a
    SpecError naming ``optimizer.<field>`` as anywhere else."""

    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        _finite("optimizer", self, STEP_OPTIMIZER_FIELDS)

    def overrides(self) -> dict[str, float]:
        return {name: value for name in STEP_OPTIMIZER_FIELDS if (value := getattr(self, name)) is not None}

    def applied_to(self, spec: OptimizerSpec) -> OptimizerSpec:
        """``spec`` with this step's values in place (validated: SpecError names the field)."""
        return replace(spec, **self.overrides()) if self.overrides() else spec

    def to_json(self) -> dict[str, float]:
        return self.overrides()

    @classmethod
    def from_json(cls, raw: Any) -> AdamStep | None:
        if raw is None:
            return None
        if not isinstance(raw, dict) or set(raw) - set(STEP_OPTIMIZER_FIELDS):
            raise SpecError("optimizer", "step", f"expected an object with keys among {STEP_OPTIMIZER_FIELDS}, "
                                                 f"got {raw!r}")
        for name, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SpecError("optimizer", name, f"must be a number, got {value!r}")
        return cls(**{name: float(value) for name, value in raw.items()})

    def to_proto(self, request: trainer_pb2.OptimStepRequest) -> trainer_pb2.OptimStepRequest:
        """Sets this step's fields on ``request`` (proto3 optional: unset stays unset) and returns it."""
        for name, value in self.overrides().items():
            setattr(request, name, value)
        return request

    @classmethod
    def from_proto(cls, request: trainer_pb2.OptimStepRequest) -> AdamStep | None:
        values = {name: getattr(request, name) for name in STEP_OPTIMIZER_FIELDS if request.HasField(name)}
        return cls(**values) if values else None


CHECKPOINTING_NAMES = {
    trainer_pb2.ACTIVATION_CHECKPOINTING_UNSPECIFIED: "auto",
    trainer_pb2.ACTIVATION_CHECKPOINTING_AUTO: "auto",
    trainer_pb2.ACTIVATION_CHECKPOINTING_ON: "on",
    trainer_pb2.ACTIVATION_CHECKPOINTING_OFF: "off",
}
CHECKPOINTING_VALUES = {name: value for value, name in CHECKPOINTING_NAMES.items() if value}


@dataclass(frozen=True)
class MemorySpec:
    """How the engine trades compute for memory (lorarl.trainer.engines.memory decides 'auto')."""

    activation_checkpointing: Checkpointing = setting(
        "auto", doc="Recompute decoder activations in backward: 'on', 'off', or 'auto' (on for micro-batches whose "
        "activations would not fit the device).")
    logits_chunk_tokens: int = setting(DEFAULT_LOGITS_CHUNK_TOKENS, doc="Tokens per LM-head/log-softmax chunk "
                                                                        "(0: a whole micro-batch at once).")

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in CHECKPOINTING:
            raise SpecError("memory", "activation_checkpointing",
                            f"must be one of {list(CHECKPOINTING)}, got {self.activation_checkpointing!r}")
        _at_least("memory", self, ("logits_chunk_tokens",), 0, " (0: no chunks)")

    def to_proto(self) -> trainer_pb2.MemoryConfig:
        return trainer_pb2.MemoryConfig(activation_checkpointing=CHECKPOINTING_VALUES[self.activation_checkpointing],
                                        logits_chunk_tokens=self.logits_chunk_tokens)

    @classmethod
    def from_proto(cls, cfg: trainer_pb2.MemoryConfig) -> MemorySpec:
        if cfg.activation_checkpointing not in CHECKPOINTING_NAMES:
            raise SpecError("memory", "activation_checkpointing",
                            f"unknown value {cfg.activation_checkpointing} (use AUTO, ON or OFF)")
        chunk = cfg.logits_chunk_tokens if cfg.HasField("logits_chunk_tokens") else DEFAULT_LOGITS_CHUNK_TOKENS
        return cls(activation_checkpointing=CHECKPOINTING_NAMES[cfg.activation_checkpointing],
                   logits_chunk_tokens=chunk)


@dataclass(frozen=True)
class MegatronSpec:
    """Model-parallel sizes of the Megatron engine; the job's ranks divided by tp * pp are data parallel."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if not 1 <= getattr(self, name) <= MAX_PARALLEL:
                raise SpecError("megatron", name, f"must be in 1..{MAX_PARALLEL}, got {getattr(self, name)}")

    def to_proto(self) -> trainer_pb2.MegatronConfig:
        return trainer_pb2.MegatronConfig(tensor_parallel_size=self.tensor_parallel_size,
                                          pipeline_parallel_size=self.pipeline_parallel_size,
                                          expert_parallel_size=self.expert_parallel_size)

    @classmethod
    def from_proto(cls, cfg: trainer_pb2.MegatronConfig) -> MegatronSpec:
        return cls(cfg.tensor_parallel_size or 1, cfg.pipeline_parallel_size or 1, cfg.expert_parallel_size or 1)


@dataclass(frozen=True)
class LimitsSpec:
    """Bounds on what a job accepts, so one client cannot exhaust the trainer's memory."""

    max_sequence_tokens: int = DEFAULT_MAX_SEQUENCE_TOKENS
    max_buffered_trajectories: int = DEFAULT_MAX_BUFFERED_TRAJECTORIES

    def __post_init__(self) -> None:
        _at_least("limits", self, ("max_sequence_tokens", "max_buffered_trajectories"), 1)


@dataclass(frozen=True)
class TrainingSpec:
    """Everything a trainer needs to build a job's engine; the proto form is lorarl.v1.JobConfig.

    ``seed`` is the job's only seed (adapter initialisation, the torch/python RNGs, so LoRA dropout).
    ``recompute_proximal`` forces decoupled PPO (proximal logprobs recomputed before the step); it is also on
    whenever the loss caps behaviour weights or masks stale tokens. ``layer_devices`` splits the torch
    engine's decoder layers across that many devices of its one process. ``init_adapter_path``: a PEFT adapter
    the adapters start from (version 1 then; 0 stays the base model). ``routing_replay`` (R3, MoE models):
    'auto' replays the experts a trajectory's routes record where the engine can (torch and Megatron, MoE
    models), 'on' insists (a job whose engine or model cannot is refused), 'off' routes live and ignores
    recorded routes.
    ``fingerprint_check``: a trajectory whose fingerprint for a version is not the one the trainer published for
    it (the rollout served other weights under that version) is refused ('refuse'), accepted and counted
    ('flag'), or not checked ('off'). ``share``: the job's weight when jobs on one resident base take turns on it
    (lorarl.trainer.service.fair_share): a job of share 2 gets twice the compute time of a job of share 1 while
    both wait.
    ``base_model_name``: the base as the job named it (a Hub id, or the path as the job file wrote it), which exports
    record where PEFT looks for the base (``base_model_name_or_path``); empty: ``base_model_path``, where this
    trainer loads it from (an absolute path of one host, which names nothing on another).
    """

    base_model_path: str
    device: str = "cpu"
    dtype: Dtype = "float32"
    lora: LoraSpec = field(default_factory=LoraSpec)
    loss: LossSpec = field(default_factory=LossSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    full_finetune: bool = False
    seed: int = 0
    engine: Engine = "torch"
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    recompute_proximal: bool = False
    megatron: MegatronSpec = field(default_factory=MegatronSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    layer_devices: int = 1
    init_adapter_path: str = ""
    routing_replay: RoutingReplay = "auto"
    fingerprint_check: FingerprintCheck = "refuse"
    share: float = 1.0
    base_model_name: str = ""

    def __post_init__(self) -> None:
        def fail(name: str, problem: str) -> None:
            raise SpecError("", name, problem)

        if not 0.001 <= self.share <= 1000:
            fail("share", f"must be 0.001..1000 (a job's weight at a shared base), got {self.share}")
        if not self.base_model_path:
            fail("base_model_path", "is required (a local Hugging Face model directory)")
        if not _DEVICE.fullmatch(self.device):
            fail("device", f"must look like 'cpu', 'cuda', 'cuda:1' or 'npu', got {self.device!r}")
        if self.dtype not in DTYPES:
            fail("dtype", f"must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.engine not in ENGINES:
            fail("engine", f"must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.seed < 0:
            fail("seed", f"must be >= 0, got {self.seed}")
        if self.engine == "megatron" and self.device.startswith("npu"):
            fail("engine", "'megatron' cannot run on Ascend NPUs: megatron-core needs MindSpeed (Ascend's adaptation "
                           "of it) there, which lorarl does not ship; use engine 'torch' on device 'npu'")
        if self.engine != "megatron" and self.megatron != MegatronSpec():
            fail("megatron", f"settings apply to engine 'megatron' only, not {self.engine!r}")
        if not 1 <= self.layer_devices <= 64:
            fail("layer_devices", f"must be 1..64, got {self.layer_devices}")
        if self.layer_devices > 1 and self.engine != "torch":
            fail("layer_devices", f"splits the torch engine's layers; engine {self.engine!r} has "
                                  "megatron.pipeline_parallel_size for that")
        if self.init_adapter_path and (self.engine != "torch" or self.full_finetune):
            fail("init_adapter_path", "(a warm start from a PEFT adapter) needs engine 'torch' and adapters "
                                      f"(engine {self.engine!r}, full_finetune {self.full_finetune})")
        if self.loss.rollout_correction.rollout_rs and self.megatron.pipeline_parallel_size > 1:
            fail("loss.rollout_correction.rollout_rs", "is not available with megatron.pipeline_parallel_size > 1: "
                 "only the last stage sees the logprobs that decide which tokens count (use rollout_is)")
        if self.routing_replay not in ROUTING_REPLAY:
            fail("routing_replay", f"must be one of {list(ROUTING_REPLAY)}, got {self.routing_replay!r}")
        if self.fingerprint_check not in FINGERPRINT_CHECKS:
            fail("fingerprint_check", f"must be one of {list(FINGERPRINT_CHECKS)}, got {self.fingerprint_check!r}")
        if self.full_finetune and self.loss.kl_coef:
            fail("loss.kl_coef", "must be 0 with full_finetune (the reference is the base with adapters off)")

    @property
    def base_model_name_or_path(self) -> str:
        """What every adapter this job exports names as its base (adapter_config.json's field of that name): the
        one rule for the torch and Megatron exports, checkpoints' offline export and the Tinker front's."""
        return self.base_model_name or self.base_model_path

    def decoupled(self, loss: LossSpec | None = None) -> bool:
        """Whether proximal logprobs must be recomputed before the step (decoupled PPO)."""
        loss = loss or self.loss
        if loss.takes_token_advantages:  # the caller's advantages already say what each token is worth
            return False
        return (self.recompute_proximal or loss.weight_cap > 0 or loss.max_staleness is not None
                or loss.rollout_correction.active)

    def to_proto(self) -> trainer_pb2.JobConfig:
        """The JobConfig with every default made explicit (what the job really runs with)."""
        return trainer_pb2.JobConfig(
            base_model_path=self.base_model_path, device=self.device, dtype=self.dtype, lora=self.lora.to_proto(),
            loss=self.loss.to_proto(), optimizer=self.optimizer.to_proto(), full_finetune=self.full_finetune,
            seed=self.seed, engine=self.engine, max_sequence_tokens=self.limits.max_sequence_tokens,
            max_buffered_trajectories=self.limits.max_buffered_trajectories, megatron=self.megatron.to_proto(),
            memory=self.memory.to_proto(), layer_devices=self.layer_devices,
            init_adapter_path=self.init_adapter_path, routing_replay=self.routing_replay,
            fingerprint_check=self.fingerprint_check, share=self.share, base_model_name=self.base_model_name)

    @classmethod
    def from_proto(cls, cfg: trainer_pb2.JobConfig, default_device: str = "cpu",
                   lora_type: type[LoraSpec] = LoraSpec) -> TrainingSpec:
        """The spec a JobConfig asks for, zeros read as unset; ``lora_type``: the trainer's checked LoraSpec.
        A lora problem is a SpecError under ``lora`` too."""
        lora = lora_type.from_proto(cfg.lora)
        return cls(
            base_model_path=cfg.base_model_path, device=cfg.device or default_device, dtype=cfg.dtype or "float32",
            lora=lora, loss=LossSpec.from_proto(cfg.loss), optimizer=OptimizerSpec.from_proto(cfg.optimizer),
            full_finetune=cfg.full_finetune, seed=cfg.seed, engine=cfg.engine or "torch",
            limits=LimitsSpec(max_sequence_tokens=cfg.max_sequence_tokens or DEFAULT_MAX_SEQUENCE_TOKENS,
                              max_buffered_trajectories=cfg.max_buffered_trajectories
                              or DEFAULT_MAX_BUFFERED_TRAJECTORIES),
            megatron=MegatronSpec.from_proto(cfg.megatron), memory=MemorySpec.from_proto(cfg.memory),
            layer_devices=cfg.layer_devices or 1, init_adapter_path=cfg.init_adapter_path,
            routing_replay=cfg.routing_replay or "auto",  # type: ignore[arg-type]  # checked on construction
            fingerprint_check=cfg.fingerprint_check or "refuse",  # type: ignore[arg-type]
            share=cfg.share or 1.0, base_model_name=cfg.base_model_name)


def loss_for_loop(loss: LossSpec, *, mode: str, max_staleness: int, max_tokens: int) -> LossSpec:
    """A job's loss with what its loop decides and the job file left unset: an async loop masks the tokens
    admission let through (``max_staleness``, and with it the weight cap's rule above); the overlong penalty
    measures against the rollout's ``max_tokens``."""
    changes: dict[str, Any] = {}
    if mode == "async" and loss.max_staleness is None:
        changes["max_staleness"] = max_staleness
    if not loss.max_response_tokens:
        changes["max_response_tokens"] = max_tokens
    return replace(loss, **changes)
