"""The rollout's OpenAI-compatible HTTP endpoint: agent code written against the official ``openai``
client samples from the policy, and every turn's exact tokens are kept per session for training."""
