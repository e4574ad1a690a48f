"""One module per `lorarl` subcommand: `add_parser(subparsers)` plus the handler it sets."""
