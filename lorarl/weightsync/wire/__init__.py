"""The wire format the weight-sync service and its clients share (see lorarl/weightsync/__init__.py)."""
