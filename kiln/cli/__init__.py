"""The `kiln` command line: one argparse subcommand per module in this package.

Depends on the modules its subcommands drive; nothing in Kiln imports it back.

A later subcommand (`env`, `launch`, `config`, `bench`) is one module with `add_parser(subparsers)`
that registers its own arguments and sets `run=` to a function taking the parsed arguments and
returning the exit status; add it to SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from kiln.cli import bench, cache, config, env, launch

SUBCOMMANDS = (launch, config, env, cache, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: fast PyTorch training through torch.compile.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kiln ...`; returns the exit status (argparse exits with 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
