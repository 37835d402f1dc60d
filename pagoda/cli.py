"""The `pagoda` command. Each subcommand lives in the part it belongs to and is imported lazily,
so `pagoda operator` runs without torch and `pagoda --help` is fast.

A subcommand module exposes `HELP: str`, `add_arguments(parser)` (torch-free) and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module implementing it. Listed here only once the subcommand does its job.
SUBCOMMANDS: dict[str, str] = {
    "operator": "pagoda.operator.cmd_operator",
    "profile": "pagoda.operator.cmd_profile",
    "serve": "pagoda.service.cli",
    "bench": "pagoda.bench.offline",
    "download": "pagoda.operator.cmd_download",
    "uninstall": "pagoda.operator.cmd_uninstall",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda",
        description="GPU-aware LLM inference services on Kubernetes.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
