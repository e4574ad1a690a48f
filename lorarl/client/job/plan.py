"""`--dry-run`: check a job config and print a memory and placement plan, without starting anything.

Sizes come from the model's config.json when the weights are present; otherwise from the
``model.shape`` named in the job file (published shapes below), so configs for real models can be
checked on a machine that has neither the weights nor the accelerators. The plan counts, per device,
the trainer's weights, adapters and their gradients, Adam moments, the activations of its largest
micro-batch (with or without activation checkpointing, as the engine will run it) and its logits
chunk, from the formulas the engine itself decides by (lorarl.trainer.engines.memory); and the rollout's
weights and KV cache, with how many whole sequences the cache holds. A plan that does not fit is an
error naming the key to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.client.job.config import records_routes
from lorarl.client.job.process_memory import SHARED_BASE, ProcessPlan, process_plans
from lorarl.client.job.step_time import IMBALANCE, StepTime, estimate
from lorarl.contract.routes import bytes_per_token as routes_bytes_per_token
from lorarl.platform import device_kind
from lorarl.trainer.engines.memory import StepMemory, dtype_bytes, needs_checkpointing, stage_sizes, step_memory

GIB = 1 << 30
ADAPTER_BYTES = 4  # adapters and their Adam moments stay fp32 whatever the base dtype
HEADROOM = 0.9  # share of a device the plan may fill before calling it "does not fit"

#: Published shapes (config.json fields) for planning without the weights.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False),
    # Qwen3.6-27B (Qwen3_5ForConditionalGeneration, text_config): hybrid layers, every 4th one full
    # (gated) attention, the others Gated DeltaNet linear attention; one MTP layer; a vision tower.
    "qwen3.6-27b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, intermediate_size=17408, vocab_size=248320, tie_word_embeddings=False,
                        attn_output_gate=True, full_attention_interval=4, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, mtp_num_hidden_layers=1,
                        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304,
                                           out_hidden_size=5120)),
}


def model_shape(cfg) -> dict[str, Any]:
    """The text model's config fields (a multimodal config's ``text_config``, vision kept alongside)."""
    config = Path(cfg.model.path) / "config.json"
    if config.is_file():
        shape = json.loads(config.read_text())
    elif getattr(cfg.model, "shape", "") in KNOWN_SHAPES:
        shape = KNOWN_SHAPES[cfg.model.shape]
    else:
        raise ValueError(f"model.path {cfg.model.path!r} has no config.json and model.shape "
                         f"{getattr(cfg.model, 'shape', '')!r} is not one of {sorted(KNOWN_SHAPES)}")
    if "text_config" in shape:
        shape = {**shape["text_config"], "vision_config": shape.get("vision_config")}
    return shape


def _is_full_attention(shape: dict[str, Any], layer: int) -> bool:
    types = shape.get("layer_types")
    if types:
        return types[layer] == "full_attention"
    interval = shape.get("full_attention_interval")
    return not interval or (layer + 1) % interval == 0


def _vision_params(vision: dict[str, Any] | None) -> int:
    """ViT blocks (attention + MLP) and the merger into the text width; patch embedding ignored."""
    if not vision:
        return 0
    w, inter = vision["hidden_size"], vision["intermediate_size"]
    return vision["depth"] * (4 * w * w + 2 * w * inter) + 4 * w * (4 * w) + 4 * w * vision.get("out_hidden_size", w)


def count(shape: dict[str, Any], rank: int, expert_mode: str = "per_expert",
          targets: frozenset[str] | None = None) -> dict[str, int]:
    """Base parameters, the expert share of them, and the LoRA parameters at ``rank`` of ``targets`` (None:
    all-linear; lorarl.contract.lora.LoraSpec.targets resolves a job's).

    LoRA counts what the trainer adapts: of every attention projection (full and Gated DeltaNet linear
    attention) and every MLP projection (experts: one adapter each with ``per_expert``, one for all with
    ``shared``, none with ``none``) those named in ``targets``; a name the model has no module of adds nothing.
    Vision towers stay frozen.
    """
    def lora(sizes: dict[str, int]) -> int:  # projection name -> in + out features
        return rank * sum(n for name, n in sizes.items() if targets is None or name in targets)

    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    hd = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    q_out = 2 * q if shape.get("attn_output_gate") else q
    attn = h * q_out + 2 * h * kv + q * h
    attn_lora = lora({"q_proj": h + q_out, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h})
    if shape.get("linear_num_value_heads"):
        keys = shape["linear_num_key_heads"] * shape["linear_key_head_dim"]
        values = shape["linear_num_value_heads"] * shape["linear_value_head_dim"]
        conv = 2 * keys + values
        heads = shape["linear_num_value_heads"]
        linear_attn = h * conv + h * values + 2 * h * heads + conv * shape.get("linear_conv_kernel_dim", 4) + values * h
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj (conv1d and the gates' scalars stay frozen)
        linear_lora = lora({"in_proj_qkv": h + conv, "in_proj_z": h + values, "in_proj_b": h + heads,
                            "in_proj_a": h + heads, "out_proj": values + h})
    else:
        linear_attn, linear_lora = attn, attn_lora
    experts = shape.get("num_experts") or shape.get("num_local_experts") or 0
    inter = shape["moe_intermediate_size"] if experts else shape["intermediate_size"]
    one_mlp_lora = lora({"gate_proj": h + inter, "up_proj": h + inter, "down_proj": inter + h})
    if experts:
        expert_params = experts * 3 * h * inter
        mlp = expert_params + experts * h
        adapted = {"per_expert": experts, "shared": 1, "none": 0}[expert_mode]
        mlp_lora = adapted * one_mlp_lora
    else:
        expert_params, mlp, mlp_lora = 0, 3 * h * inter, one_mlp_lora
    full = sum(_is_full_attention(shape, i) for i in range(layers))
    mtp = shape.get("mtp_num_hidden_layers", 0) * (attn + mlp + 2 * h * h)
    embed = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    base = embed + full * attn + (layers - full) * linear_attn + layers * mlp + mtp
    vision = _vision_params(shape.get("vision_config"))
    return {"base": base + vision, "vision": vision, "expert_params": layers * expert_params,
            "outside_layers": embed + mtp + vision,  # what a torch layer split keeps on its first device
            "lora": full * attn_lora + (layers - full) * linear_lora + layers * mlp_lora,
            "lora_experts": layers * mlp_lora if experts else 0, "experts": experts}


def job_count(cfg, shape: dict[str, Any], rank: int | None = None) -> dict[str, int]:
    """`count` for a job: its LoRA section's rank (or ``rank``: a rollout's serving rank), experts and targets."""
    lora = cfg.trainer.lora
    return count(shape, rank or lora.rank, lora.expert_mode, lora.spec().targets())


def adaptable(shape: dict[str, Any]) -> list[str]:
    """The projection names this model shape has LoRA can adapt (what a job's target_modules may name)."""
    from lorarl.contract.lora import DENSE_TARGETS, LINEAR_ATTENTION_TARGETS

    return [*DENSE_TARGETS, *(LINEAR_ATTENTION_TARGETS if shape.get("linear_num_value_heads") else ())]


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


@dataclass(frozen=True)
class Slot:
    """One process group's devices: which node and which device indices there."""

    role: str
    node: int
    devices: tuple[int, ...]


def place(cfg) -> list[Slot]:
    """Trainer ranks fill node 0 (then the next nodes) first; each rollout replica's TP group then
    takes the next free devices of one node (a vLLM TP group never spans nodes). Co-located, the one replica is on
    the trainer's device."""
    per_node = cfg.placement.devices_per_node
    free = [list(range(per_node)) for _ in range(cfg.placement.nodes)]
    slots: list[Slot] = []
    ranks = cfg.trainer.parallel.world_size
    node = 0
    while ranks:
        take = min(ranks, len(free[node]))
        if take:
            slots.append(Slot("trainer", node, tuple(free[node][:take])))
            del free[node][:take]
            ranks -= take
        node += 1
    if cfg.placement.colocate:  # the one rollout replica computes on the trainer's devices (and base)
        return [*slots, Slot("rollout-0", slots[0].node, slots[0].devices)]
    tp = cfg.rollout.tensor_parallel_size
    for replica in range(cfg.rollout.replicas):
        node = next((n for n, devices in enumerate(free) if len(devices) >= tp), None)
        if node is None:
            raise ValueError(f"rollout replica {replica} needs {tp} devices on one node; none is left "
                             "(fewer replicas, a smaller rollout.tensor_parallel_size, or more nodes)")
        slots.append(Slot(f"rollout-{replica}", node, tuple(free[node][:tp])))
        del free[node][:tp]
    return slots


@dataclass(frozen=True)
class TrainerMemory:
    """One trainer device's peak bytes in a step, by part (lorarl.trainer.engines.memory's formulas)."""

    weights: float
    adapters: float  # fp32 adapters + their gradients
    adam: float
    step: StepMemory  # activations and logits chunk of the largest micro-batch, as the job runs
    unchecked: StepMemory  # the same micro-batch without activation checkpointing
    checkpointed: StepMemory  # and with it
    sequence_tokens: int

    @property
    def static(self) -> float:
        return self.weights + self.adapters + self.adam

    @property
    def total(self) -> float:
        return self.static + self.step.total


def micro_batch_tokens(cfg) -> tuple[int, int]:
    """(tokens of the largest micro-batch per trainer rank, tokens of one sequence) the plan assumes."""
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_tokens
    per_rank = -(-cfg.loop.prompts_per_step * cfg.rollout.group_size // cfg.trainer.parallel.data) * seq
    budget = cfg.trainer.optimizer.micro_batch_tokens
    # A micro-batch holds whole sequences: at most the budget, but never less than one sequence.
    return (max(min(budget, per_rank), seq) if budget else per_rank), seq


def trainer_memory(cfg, shape: dict[str, Any], n: dict[str, int], free_bytes: float | None) -> TrainerMemory:
    """Weights, adapters, Adam and the step's activations on one trainer device; ``free_bytes`` (the
    device's memory, None if unknown) decides ``activation_checkpointing: auto`` as the engine does."""
    width = dtype_bytes(cfg.model.dtype)
    par = cfg.trainer.parallel
    # Dense weights split by TP x PP, experts additionally by EP.
    dense_bytes = (n["base"] - n["expert_params"]) * width
    weights = dense_bytes / (par.tensor * par.pipeline) + n["expert_params"] * width / (
        par.tensor * par.pipeline * par.expert)
    adapters = ((n["lora"] - n["lora_experts"]) / (par.tensor * par.pipeline) + n["lora_experts"] / (
        par.tensor * par.pipeline * par.expert)) * ADAPTER_BYTES
    tokens, seq = micro_batch_tokens(cfg)
    memory = cfg.trainer.memory
    layers = -(-shape["num_hidden_layers"] // par.pipeline)
    if cfg.trainer.engine == "torch" and par.pipeline > 1:
        # The torch engine's layer split (lorarl.trainer.engines.torch.layer_split): whole layers per device, the
        # embeddings and head on the first; the fullest device is the one that counts.
        total_layers = shape["num_hidden_layers"]
        per_layer = (n["base"] - n["outside_layers"]) / total_layers
        sizes = stage_sizes(n["outside_layers"], [per_layer] * total_layers, par.pipeline)
        layers = max(sizes)
        weights = max(n["outside_layers"] + sizes[0] * per_layer, layers * per_layer) * width
        adapters = n["lora"] * layers / total_layers * ADAPTER_BYTES
    rank, dtype, chunk = cfg.trainer.lora.rank, cfg.model.dtype, memory.logits_chunk_tokens
    with_grads, adam = 2 * adapters, 2 * adapters  # adapters and their gradients; two Adam moments
    static = weights + with_grads + adam
    # The torch engine takes a frozen head's gradient in closed form, in chunks; Megatron's output layer
    # goes through autograd over the whole micro-batch's logits.
    frozen_head = cfg.trainer.engine == "torch"
    if not frozen_head:
        chunk = 0
    if memory.activation_checkpointing == "auto":
        checkpointing = free_bytes is not None and needs_checkpointing(shape, rank, dtype, tokens, chunk,
                                                                        int(free_bytes - static), layers, frozen_head)
    else:
        checkpointing = memory.activation_checkpointing == "on"

    def per_device(on: bool) -> StepMemory:
        # Tensor parallelism splits the layers' activations (not the LM-head chunk, gathered per rank).
        return step_memory(shape, rank, dtype, tokens, on, chunk, layers, frozen_head=frozen_head).split(par.tensor)

    return TrainerMemory(weights, with_grads, adam, per_device(checkpointing), per_device(False), per_device(True),
                         seq)


def kv_bytes_per_token(shape: dict[str, Any], dtype: str) -> int:
    """The rollout's KV cache per token: keys and values of every full-attention layer."""
    hd = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    full = sum(_is_full_attention(shape, i) for i in range(shape["num_hidden_layers"]))
    return 2 * full * shape["num_key_value_heads"] * hd * (2 if dtype == "bfloat16" else 4)


def moe_layers(shape: dict[str, Any]) -> int:
    """Decoder layers with a router: all but ``mlp_only_layers``, every ``decoder_sparse_step``-th."""
    step = shape.get("decoder_sparse_step") or 1
    dense = set(shape.get("mlp_only_layers") or ())
    return sum(1 for i in range(shape["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def routing_replay_line(cfg, shape: dict[str, Any], experts: int, sequence_tokens: int) -> str:
    """What routing replay costs this job (lorarl.contract.routes), or why it is off."""
    t = cfg.trainer
    if not records_routes(cfg, moe=True):
        why = "trainer.routing_replay is off" if t.routing_replay == "off" else "rollout.engine is not vllm"
        return f"off ({why})"
    layers, top_k = moe_layers(shape), shape.get("num_experts_per_tok") or 1
    per_token = routes_bytes_per_token(layers, top_k, experts)
    batch = per_token * sequence_tokens * cfg.loop.prompts_per_step * cfg.rollout.group_size
    return (f"on ({t.routing_replay}): the rollouts record {layers} MoE layers x top-{top_k} of {experts} experts, "
            f"{per_token} B per token, up to {human_bytes(batch)} per step at full length (sent with the "
            f"trajectories, held in the trainer's buffer); the rollouts run without prefix caching (a cached "
            f"position is never computed, so it has no route)")


def rollout_lora_blocker(cfg, shape: dict[str, Any] | None = None, is_moe: bool | None = None,
                         environ: Any = None) -> str:
    """Why this job's rollouts will start without LoRA layers ("" when they serve adapters): the rule the
    rollout's engine applies at start (lorarl.common.vllm_lora), with the job's own settings."""
    import os

    from lorarl.common.vllm_lora import lora_blocker

    if shape is None:
        shape = model_shape(cfg)
        is_moe = bool(job_count(cfg, shape)["experts"])
    environ = os.environ if environ is None else environ
    device_type = cfg.trainer.device.split(":", 1)[0]
    blocker = lora_blocker(bool(is_moe), device_type, shape, environ) if cfg.rollout.engine == "vllm" else ""
    if blocker:
        return blocker
    if cfg.rollout.enable_lora is False:
        return "rollout.enable_lora is false"
    if cfg.rollout.enable_lora is None and cfg.sync.mode == "merged":
        return "a merged job's rollouts need no LoRA layers; rollout.enable_lora: true keeps them"
    return ""


def colocation_refusal(cfg, shape: dict[str, Any], is_moe: bool) -> str:
    """Why this job's base cannot be shared by its trainer and rollout ("" when it can), beyond what the job file's
    own check says (JobFileConfig._check_colocate): an engine without LoRA, which would merge every version into
    the shared base, or a checkpoint in another dtype than the job computes in (one copy, one dtype)."""
    from lorarl.contract.base_segment import checkpoint_index
    from lorarl.platform.shared_memory import SegmentError

    blocker = rollout_lora_blocker(cfg, shape, is_moe)
    if blocker:
        return (f"the rollout engine would serve no LoRA ({blocker}), so every version would be merged into the "
                "base the trainer computes on; co-location needs an engine that serves adapters")
    try:
        codes = {dtype for *_, dtype in checkpoint_index(cfg.model.path).values()}
    except (SegmentError, OSError):  # a plan from model.shape alone: no checkpoint to compare yet
        return ""
    wanted = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(cfg.model.dtype)
    if codes != {wanted}:
        return (f"the checkpoint's tensors are {sorted(codes)}, the job computes in {cfg.model.dtype}: the one shared "
                "copy is the checkpoint's bytes; set model.dtype to the checkpoint's")
    return ""


def sync_choice(cfg, shape: dict[str, Any], is_moe: bool, environ: Any = None) -> tuple[str, str]:
    """The sync mode the job will run in and why, and whether its rollouts start vLLM with LoRA and why. An
    adapter job whose rollouts have no LoRA merges each version locally on every replica (its own rollout only:
    a shared one refuses it, lorarl.contract.sharing)."""
    cannot = rollout_lora_blocker(cfg, shape, is_moe, environ)
    if cfg.sync.mode == "merged":
        mode = "merged (sync.mode)"
    elif cfg.sync.mode == "adapter" and cannot:
        mode = f"adapter (sync.mode), merged locally on each replica because {cannot}"
    elif cfg.sync.mode == "adapter":
        mode = "adapter (sync.mode)"
    elif cannot:
        mode = f"merged (auto: {cannot})"
    else:
        mode = f"adapter (auto: every replica serves LoRA rank {cfg.trainer.lora.rank})"
    if cannot:
        lora = f"off ({cannot})"
    elif cfg.rollout.enable_lora:
        lora = f"on (rollout.enable_lora), up to rank {cfg.serving_lora_rank}"
    else:
        lora = f"on (the default where the model can run it), up to rank {cfg.serving_lora_rank}"
    if lora.startswith("on") and mode.startswith("merged"):
        lora += "; merged weights load into its LoRA-wrapped layers"
    return mode, lora


def print_plan(cfg) -> int:
    try:
        shape = model_shape(cfg)
    except ValueError as e:
        print(f"lorarl: bad config: model.path: {e}")
        return 2
    n = job_count(cfg, shape)
    if n["lora"] == 0:
        print(f"lorarl: bad config: trainer.lora.target_modules: {list(cfg.trainer.lora.target_modules)} match no "
              f"module of {cfg.model.path} (its adaptable projections: {', '.join(adaptable(shape))}): nothing would "
              "train")
        return 2
    width = dtype_bytes(cfg.model.dtype)
    par = cfg.trainer.parallel
    base_bytes = n["base"] * width
    device_memory = cfg.placement.device_memory_gib * GIB if cfg.placement.devices_per_node else 0.0
    kv = cfg.rollout.kv_cache_gib * GIB
    # co-located, the trainer's step has the device less the rollout's KV cache (the base is counted once, in it)
    trainer_room = (HEADROOM * device_memory - (kv if cfg.placement.colocate else 0)) if device_memory else None
    trainer = trainer_memory(cfg, shape, n, trainer_room)
    rollout_base = base_bytes / cfg.rollout.tensor_parallel_size
    kv_per_token = kv_bytes_per_token(shape, cfg.model.dtype) / cfg.rollout.tensor_parallel_size
    mode, rollout_lora = sync_choice(cfg, shape, is_moe=bool(n["experts"]))

    print(f"job {cfg.job_id}: {cfg.loop.mode} loop, {cfg.loop.steps} steps x {cfg.loop.prompts_per_step} prompts x "
          f"{cfg.rollout.group_size} samples, staleness <= {cfg.loop.max_staleness}")
    extras = [f"{n['experts']} experts"] if n["experts"] else []
    if n["vision"]:
        extras.append(f"vision tower {human_count(n['vision'])} (frozen, not adapted)")
    print(f"model {cfg.model.path}: {human_count(n['base'])} parameters ({human_bytes(base_bytes)} in "
          f"{cfg.model.dtype})" + (f", {', '.join(extras)}" if extras else ""))
    print(f"adapters: rank {cfg.trainer.lora.rank}, {human_count(n['lora'])} parameters "
          f"({100 * n['lora'] / n['base']:.2f}% of base), {human_bytes(n['lora'] * ADAPTER_BYTES)} fp32")
    step, unchecked = trainer.step, trainer.unchecked
    ckpt_mode = cfg.trainer.memory.activation_checkpointing
    ckpt = ("on" if step.checkpointing else "off") + (" (auto)" if ckpt_mode == "auto" else "")
    layout = (f"decoder layers split across {par.pipeline} devices, one computing at a time"
              if cfg.trainer.engine == "torch" and par.pipeline > 1
              else f"TP {par.tensor} x PP {par.pipeline} x DP {par.data}, EP {par.expert}")
    print(f"trainer ({cfg.trainer.engine} engine, {cfg.trainer.device}, {layout}): per device base "
          f"{human_bytes(trainer.weights)} + adapters and grads "
          f"{human_bytes(trainer.adapters)} + Adam {human_bytes(trainer.adam)} + step {human_bytes(step.total)} "
          f"(activations kept {human_bytes(step.kept)}, then the larger of one recomputed layer "
          f"{human_bytes(step.recompute)} and the logits chunk {human_bytes(step.logits)}) "
          f"= {human_bytes(trainer.total)}")
    if cfg.trainer.engine == "torch":  # jobs on one base share it in one trainer (engines.torch.shared_base)
        print(f"trainer, shared: the base ({human_bytes(trainer.weights)} per device) is resident once for every "
              f"job on it; each more job like this one adds {human_bytes(trainer.adapters + trainer.adam)} "
              f"(adapter, gradients, Adam), and the step's activations while it computes")
    print(f"trainer activations: micro-batch of {step.tokens:,} tokens ({trainer.sequence_tokens:,}-token sequences: "
          f"data.max_prompt_tokens + rollout.max_tokens); checkpointing {ckpt}: {human_bytes(step.activations)}, "
          f"without: {human_bytes(unchecked.activations)}")
    sequences = kv / (kv_per_token * trainer.sequence_tokens) if kv_per_token else float("inf")
    print(f"rollout ({cfg.rollout.engine}, {cfg.rollout.replicas} replica(s) x TP {cfg.rollout.tensor_parallel_size}):"
          f" per device base {human_bytes(rollout_base)} + KV cache {human_bytes(kv)} "
          f"({human_bytes(kv_per_token)} per token: {sequences:,.1f} full sequences)")
    print(f"weight sync: {mode}; per version {human_bytes(n['lora'] * ADAPTER_BYTES)} (adapter, fp32) vs "
          f"{human_bytes(base_bytes)} (merged)")
    print(f"rollout LoRA: {rollout_lora}")
    if cfg.placement.colocate:
        refusal = colocation_refusal(cfg, shape, bool(n["experts"]))
        if refusal:
            print(f"lorarl: bad config: placement.colocate: {refusal}")
            return 2
        if device_kind(cfg.trainer.device) == "cpu":
            print(f"co-located: ONE copy of the base ({human_bytes(base_bytes)}) in shared memory the launcher holds, "
                  "mapped read-only by the trainer and the rollout engine (the per-process figures above each count "
                  "it; the host holds it once); adapters reach the rollout as memory files")
        else:
            print(f"co-located: ONE copy of the base ({human_bytes(base_bytes)}) per device, shared by CUDA IPC "
                  "between the trainer and the rollout engine (the figures above each count it; the device holds "
                  "it once: the table below); a plan only: `lorarl run` does not start it on CUDA yet")
    _print_processes(_service_plans(cfg, shape, n, trainer, mode, rollout_lora) if plans_processes(cfg) else None)
    if n["experts"]:
        print(f"routing replay (R3): {routing_replay_line(cfg, shape, n['experts'], trainer.sequence_tokens)}")
    if sequences < 1:
        print(f"lorarl: bad config: rollout.kv_cache_gib: {human_bytes(kv)} holds "
              f"{int(kv / kv_per_token):,} tokens, less than one {trainer.sequence_tokens:,}-token sequence")
        return 2
    if cfg.placement.devices_per_node:
        try:
            slots = place(cfg)
        except ValueError as e:
            print(f"lorarl: bad config: placement: {e}")
            return 2
        for node in range(cfg.placement.nodes):
            here = [f"{s.role} (devices {s.devices[0]}-{s.devices[-1]})" if len(s.devices) > 1
                    else f"{s.role} (device {s.devices[0]})" for s in slots if s.node == node]
            print(f"node {node}: " + (", ".join(here) if here else "idle"))
        speed = cfg.placement
        if speed.device_tflops and speed.device_bandwidth_gbs:
            _print_step_time(estimate(cfg, shape, n, trainer.step.checkpointing, kv_per_token, speed.device_tflops,
                                      speed.device_bandwidth_gbs), cfg)
        if device_memory and cfg.placement.colocate:
            return _check_colocated_fit(trainer, kv, kv_per_token, device_memory)
        if device_memory:
            return _check_fit(trainer, rollout_base + kv, device_memory)
    return 0


def _check_colocated_fit(trainer: TrainerMemory, kv: float, kv_per_token: float, memory: float) -> int:
    """One budget for the one device a co-located job runs on: the base once, the trainer's adapters, gradients,
    Adam and step, and the rollout's KV cache, all resident at once (a fixed split: what runs today; the
    time-shared figure, the KV cache released while a step trains, is printed beside it, not built)."""
    limit = HEADROOM * memory
    rows = [("base, ONE copy (trainer and rollout)", trainer.weights),
            ("trainer adapters and gradients (fp32)", trainer.adapters), ("trainer Adam moments", trainer.adam),
            (f"trainer step ({trainer.step.tokens:,}-token micro-batch)", trainer.step.total),
            ("rollout KV cache (rollout.kv_cache_gib)", kv)]
    total = sum(size for _, size in rows)
    print(f"per device (co-located: trainer and rollout on one device of {human_bytes(memory)}, "
          f"{human_bytes(limit)} usable):")
    for name, size in rows:
        print(f"  {name:<48} {human_bytes(size):>10}")
    verdict = "fits" if total <= limit else "DOES NOT FIT"
    print(f"  {'total, all resident at once':<48} {human_bytes(total):>10}: {verdict}")
    separate = total + trainer.weights  # the base a second time
    print(f"  (separate copies would need {human_bytes(separate)}; the KV cache released while a step trains would "
          f"need {human_bytes(total - min(kv, trainer.step.total))}: not built)")
    spare = limit - (total - kv)
    if kv_per_token and spare > 0:
        print(f"  context: the KV cache holds {int(kv / kv_per_token):,} tokens at once; the largest it could be "
              f"here is {human_bytes(spare)} ({int(spare / kv_per_token):,} tokens)")
    if total > limit:
        print(f"lorarl: bad config: rollout.kv_cache_gib: co-located, the device needs {human_bytes(total)} of "
              f"{human_bytes(limit)} usable; a smaller KV cache or trainer.optimizer.micro_batch_tokens")
        return 2
    return 0


def plans_processes(cfg) -> bool:
    """Whether host memory per process is planned: CPU runs with vLLM (the only ones measured)."""
    return cfg.trainer.device.split(":", 1)[0] == "cpu" and cfg.rollout.engine == "vllm" and \
        not cfg.placement.devices_per_node


def service_plans(cfg) -> list[ProcessPlan] | None:
    """Each service process's planned peak resident memory (lorarl.client.job.process_memory), as `--dry-run`
    prints it; None where it is not planned (plans_processes)."""
    if not plans_processes(cfg):
        return None
    shape = model_shape(cfg)
    n = job_count(cfg, shape)
    mode, rollout_lora = sync_choice(cfg, shape, is_moe=bool(n["experts"]))
    return _service_plans(cfg, shape, n, trainer_memory(cfg, shape, n, None), mode, rollout_lora)


def _service_plans(cfg, shape: dict[str, Any], n: dict[str, int], trainer: TrainerMemory, mode: str,
                   rollout_lora: str) -> list[ProcessPlan]:
    serving = job_count(cfg, shape, cfg.serving_lora_rank)["lora"]
    return process_plans(cfg, shape, n, serving, trainer.total, n["base"] * dtype_bytes(cfg.model.dtype),
                         cfg.rollout.kv_cache_gib * GIB, lora_on=rollout_lora.startswith("on"),
                         merged=mode.startswith("merged"))


def shared_service_plans(cfgs: list, rollout: dict[str, Any]) -> list[ProcessPlan] | None:
    """The processes of one stack several jobs share (`lorarl run A.yaml B.yaml`), None where not planned.

    The trainer holds the base once, every job's adapters, gradients and Adam, one step's activations at a time
    (the jobs take turns at the base; from the second job on they share one malloc arena) and every job's
    trajectories; the rollout is sized for all (``rollout``: the stack's rollout section, as
    lorarl.client.launch.many_jobs.shared_sections makes it: its LoRA rank and slots, its KV cache) and holds every
    job's requests in flight; weight sync is one process."""
    import copy

    if not all(plans_processes(cfg) for cfg in cfgs):
        return None
    each, memories = [], []
    for cfg in cfgs:
        sized = copy.deepcopy(cfg)
        sized.rollout.max_lora_rank = rollout["max_lora_rank"]
        sized.rollout.max_loras = rollout["max_loras"]
        sized.rollout.kv_cache_gib = rollout["kv_cache_gib"]
        shape = model_shape(sized)
        n = job_count(sized, shape)
        memory = trainer_memory(sized, shape, n, None)
        rollout_lora = sync_choice(sized, shape, bool(n["experts"]))[1]
        each.append(_service_plans(sized, shape, n, memory, "adapter", rollout_lora))
        memories.append(memory)
    trainer_key, held = "weights, adapters, Adam and step", "trajectories"
    plans = []
    for index, first in enumerate(each[0]):
        parts = dict(first.parts)
        if first.name == "trainer":
            parts[trainer_key] = (memories[0].weights + sum(m.adapters + m.adam for m in memories)
                                  + max(m.step.total for m in memories))
            parts[held] = sum(plans[index].parts[held] for plans in each)
        elif "requests in flight" in parts:
            parts["requests in flight"] = sum(plans[index].parts["requests in flight"] for plans in each)
        plans.append(ProcessPlan(first.name, parts))
    return plans


def print_shared_processes(plans: list[ProcessPlan] | None) -> None:
    """`lorarl run A.yaml B.yaml --dry-run`: the shared stack's processes."""
    print("the shared stack's ", end="")
    _print_processes(plans)


def _print_processes(plans: list[ProcessPlan] | None) -> None:
    if plans is None:
        print("processes: host memory per process is planned for CPU runs with vLLM only (the device plan above "
              "holds the accelerators; host memory of a GPU or NPU run was not measured)")
        return
    shared = sum(p.parts.get(SHARED_BASE, 0.0) for p in plans)  # co-located: also in the trainer's figure
    print(f"processes (peak resident memory, as `lorarl run` starts them; "
          f"{human_bytes(sum(p.total for p in plans) - shared)} together if every peak met"
          + (", the shared base counted once" if shared else "") + "):")
    for plan in plans:
        parts = " + ".join(f"{k} {human_bytes(v)}" for k, v in plan.parts.items())
        print(f"  {plan.name}: {human_bytes(plan.total)} ({parts})")


def _print_step_time(t: StepTime, cfg) -> None:
    if cfg.placement.colocate:  # one device: generation and training take turns on it, nothing to balance
        print(f"step time estimate (lorarl/client/job/step_time.py): train ~{t.train_s:,.0f} s and generate "
              f"~{t.generate_s:,.0f} s ({t.concurrency} sequences at once, {t.waves} wave(s)) on the one device, "
              f"taking turns: ~{t.train_s + t.generate_s:,.0f} s a step")
        return
    print(f"step time estimate (lorarl/client/job/step_time.py): train ~{t.train_s:,.0f} s on "
          f"{cfg.trainer.parallel.world_size} device(s), generate ~{t.generate_s:,.0f} s on {cfg.rollout.replicas} "
          f"replica(s) ({t.concurrency} sequences at once, {t.waves} wave(s)): "
          + ("balanced" if t.ratio <= IMBALANCE else "IMBALANCED"))
    if t.ratio > IMBALANCE:
        slower = "training" if t.train_s > t.generate_s else "generation"
        fix = ("more trainer devices (trainer.parallel.data or tensor) or fewer rollout replicas"
               if slower == "training"
               else "more rollout replicas or fewer trainer devices")
        print(f"warning: {slower} takes {t.ratio:.1f}x as long as the other half of the step; {fix}")


def _check_fit(trainer: TrainerMemory, rollout: float, memory: float) -> int:
    """Whether the trainer and a rollout replica fit their devices; a misfit names the key to change."""
    limit = HEADROOM * memory
    for role, used in (("trainer", trainer.total), ("rollout", rollout)):
        verdict = "fits" if used <= limit else "DOES NOT FIT"
        print(f"{role}: {human_bytes(used)} of {human_bytes(memory)} per device: {verdict}")
    if trainer.total > limit:
        need = human_bytes(trainer.total)
        if trainer.static > limit:
            key, hint = "placement.device_memory_gib", "weights and optimiser state alone do not fit: more "\
                "parallelism (trainer.parallel.*) or larger devices"
        elif not trainer.step.checkpointing and trainer.static + trainer.checkpointed.total <= limit:
            key, hint = "trainer.memory.activation_checkpointing", "set it to 'on' (or 'auto')"
        else:
            key, hint = "trainer.optimizer.micro_batch_tokens", "a smaller micro-batch (or more parallelism)"
        print(f"lorarl: bad config: {key}: the trainer needs {need} per device of {human_bytes(limit)} usable; {hint}")
        return 2
    if rollout > limit:
        print(f"lorarl: bad config: rollout.kv_cache_gib: a rollout replica needs {human_bytes(rollout)} per device "
              f"of {human_bytes(limit)} usable (a smaller KV cache or a larger rollout.tensor_parallel_size)")
        return 2
    return 0

