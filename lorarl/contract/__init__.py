"""What every lorarl process agrees on, beyond the protos: the LoRA spec (lora.py), the merge (merge.py),
a base checkpoint's identity (fingerprint.py) and the staleness rule (staleness.py). Services and
clients import from here; nothing here imports a service."""
