"""lorarl: lorarl/trainer, in four layers, each importing only the ones below it.

- ``rl``: the RL math that knows no engine: LoRA layers and the GRPO-family losses.
- ``engines``: what trains a policy: the engine interface, the factory, the torch and Megatron
  engines, batching, prefix sharing, memory-saving recompute, checkpoints and export.
- ``ranks``: the multi-rank plumbing: commands rank 0 broadcasts, the control group, launch, followers.
- ``service``: the gRPC servicer over the plain job manager, its config and the proto conversions.
"""
