"""The wire format the weight-sync service and its clients share (see services/weightsync/__init__.py)."""
