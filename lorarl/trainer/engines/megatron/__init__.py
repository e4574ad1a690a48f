"""The Megatron-core trainer engine: HF Qwen3 checkpoints as megatron GPT models with TP/PP/EP.

Kept in its own package so the torch engine and the server never import megatron-core unless a job
asks for ``engine="megatron"``.
"""
