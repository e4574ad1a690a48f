"""The weight-sync client libraries the trainer and the rollout embed; nothing here imports the service."""
