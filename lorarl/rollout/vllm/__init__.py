"""vLLM behind lorarl's GenerationEngine, split by role like vLLM's own lora/ package: engine.py (the engine on
AsyncLLM), plugin.py (the general plugin vLLM loads in each process), worker_ext.py (loading and staging
adapters and weights inside the worker: the one place that knows vLLM internals), cpu_lora_ops.py (the
faster CPU LoRA path) and cpu_fixes.py (vLLM CPU bugs worked around, each with its canary test)."""
