"""lorarl: lorarl/rollout — generation with versioned policies (adapters at run time, or merged weights).

server          thin RolloutService servicer; `lorarl serve rollout` (serve_forever), start_rollout
config          the `rollout:` section (engine, memory, LoRA limits, adapter window, queue limit)
factory         builds a started RolloutCore from settings
core            engine-neutral replica: segments, per-token version tags, switches, admission, policy updates
policies        which versions are loaded, which serves a request, when an old one may be unloaded
gate            readers/writer gate between request submission and weight switches
engine_api      the GenerationEngine contract every engine implements
vllm/           vLLM, by role: engine (GenerationEngine on AsyncLLM: continuous batching, run-time LoRA,
                in-place reloads), plugin, worker_ext (the one module touching vLLM internals: in-memory
                adapters and weight staging in the worker), cpu_lora_ops, cpu_fixes
hf_engine       GenerationEngine on transformers (no vLLM needed; the reference in parity tests)
sink            PolicySink for the weight-sync agent (stage / commit / abort / active_versions)
sync            starts the weight-sync agent of a replica (subscribe, stage, commit, report)
payloads        checks a payload against the served model; completes merged weights; local merges
loading         the LoadWeights stream (manifest, chunks, checksums)
client          LoadWeights request streams for clients
validation      Generate requests to validated plain data (INVALID_ARGUMENT naming the field)
convert         plain data to protobuf responses; manifests to payloads
model_files     config, generation config and safetensors headers of a model directory
prompts         text prompts (chat template) to token ids and back
schema          the plain data types shared by all of the above
"""
