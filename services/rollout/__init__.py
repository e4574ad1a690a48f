"""lorarl: services/rollout."""
