"""The RL loop and what keeps it going: the job's session on the trainer, recovery, the rollout pool and
fleet, the rollout preflight, and where the numbers go (run log, progress line)."""
