"""`python -m lorarl.common.health_probe HOST:PORT`: exit 0 if the server reports SERVING, else 1.

For container healthchecks and supervisors: it asks the standard grpc.health.v1 service, which
needs no token (see lorarl.common.auth), so a probe holds no secret. Plaintext only; a TLS
server is probed with grpc_health_probe or a client that has its CA.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def probe(target: str, service: str = "", timeout_s: float = 3.0) -> bool:
    """Whether `service` ('' = the server as a whole) at `target` answers SERVING within the timeout."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorarl.common.health_probe", description=__doc__)
    parser.add_argument("target", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help="a full service name, e.g. lorarl.v1.TrainerService")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    serving = probe(args.target, args.service, args.timeout)
    if not serving:
        print(f"{args.target}: not serving", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
