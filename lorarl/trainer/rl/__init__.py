"""RL math that knows no engine: LoRA layers, losses, trajectories and batching, the one RL step."""
