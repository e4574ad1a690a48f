"""lorarl: lorarl/trainer, in four layers, each importing only the ones below it.

- ``rl``: the RL math that knows no engine: LoRA layers, the GRPO-family losses, trajectories and
  their batching, and the one RL step (over a model backend and a gradient reducer).
- ``engines``: what trains a policy: the engine interface, the factory, the torch and Megatron
  engines, batching, prefix sharing, memory-saving recompute, checkpoints and export.
- ``ranks``: the multi-rank plumbing: commands rank 0 broadcasts, the control group, launch, followers.
- ``service``: the gRPC servicer over the plain job manager, its config and the proto conversions.
"""
