"""The Tinker API over lorarl: an HTTP front the official `tinker` client drives unchanged (`base_url`,
an API key), translating its calls into the trainer's and the rollout's gRPC calls.

The wire format is the SDK 0.38's (docs/tinker_protocol.md): futures polled through `retrieve_future`,
protobuf bodies for forward_backward and for sample / forward_backward results, each model's requests run
in its `seq_id` order. `futures.py` holds the futures and that order, `wire.py` the conversions between
Tinker data and lorarl trajectories, `app.py` the routes, `backend.py` the gRPC calls.
"""
