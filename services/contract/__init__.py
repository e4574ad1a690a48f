"""What every lorarl process agrees on, beyond the protos: the LoRA spec (lora.py), the merge (merge.py)
and a base checkpoint's identity (fingerprint.py). Services and clients import from here; nothing here
imports a service."""
