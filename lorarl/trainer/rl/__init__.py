"""RL math that knows no engine: LoRA layers and the GRPO-family losses."""
