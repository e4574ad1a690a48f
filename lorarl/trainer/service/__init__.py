"""The trainer service: gRPC servicer, job manager, trajectory validation, proto conversions, config."""
