"""What every lorarl process agrees on, beyond the protos: the LoRA spec (lora.py), the merge (merge.py),
a base checkpoint's identity (fingerprint.py), the staleness rule (staleness.py) and the enum names
(enums.py). Services and clients import from here; nothing here imports a service."""
