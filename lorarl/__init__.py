"""lorarl: LoRA reinforcement learning for LLMs as three gRPC services and a client.

One import root. The services: ``lorarl.trainer``, ``lorarl.rollout``, ``lorarl.weightsync``; what they
share: ``lorarl.common`` (server, channels, config) and ``lorarl.contract`` (LoRA spec, merge,
fingerprint, staleness); the client: ``lorarl.client`` (the ``lorarl`` command and the RL loop);
``lorarl.assets`` (the tiny models and tasks the repo ships); ``lorarl.v1`` (code generated from
protos/, never edited). docs/architecture.md draws the map.
"""
