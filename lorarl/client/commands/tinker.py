"""`lorarl tinker JOB [key=value ...]`: a job file's services and the Tinker front over them, until Ctrl-C.

It prints TINKER_BASE_URL and TINKER_API_KEY for the official `tinker` client (examples/tinker/rl_loop.py).
The job file says the model (served under its folder's name) and how the services run; its loop, data and
reward are not used: the client brings those. `lorarl serve tinker` runs the front alone, over services
started elsewhere. Ctrl-C and SIGTERM stop the front and its services; a launcher killed by SIGKILL leaves none
running either (each service watches it: lorarl.common.parent_watch).
"""

from __future__ import annotations

import argparse
import contextlib
import threading
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("tinker", help="serve the Tinker API over a job file's services",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="job file: the model and how its services run")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="job-file overrides")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lorarl.client.interrupt import stop_on_sigterm
    from lorarl.client.launch.tinker import local_front

    stop_on_sigterm()  # a supervisor's stop ends the front and its services as Ctrl-C does
    try:
        with local_front(args.config, args.overrides) as front:
            print(f"export TINKER_BASE_URL={front.base_url}\nexport TINKER_API_KEY={front.api_key}\n"
                  f"# base_model {front.base_model!r}; Ctrl-C stops the services", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                threading.Event().wait()
    except KeyboardInterrupt:  # stopped while the services started: what did start is stopped
        return 130
    return 0
