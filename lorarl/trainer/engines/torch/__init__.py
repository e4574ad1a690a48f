"""The torch engine (transformers' model with lorarl's LoRA layers), in a room of its own beside
``megatron/``: the engine (`engine`), the base it shares between jobs (`shared_base`), its layer split over
devices (`layer_split`), its shared-prompt forward (`prefix_sharing`) and its routing replay hooks
(`routing_replay`). What both engines use lives one floor down, in lorarl.trainer.engines (the API, the policy
engine, checkpoints, memory, recompute) and lorarl.trainer.rl (the math, the R3 selection rule).
"""
