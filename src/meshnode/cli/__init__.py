"""The ``meshnode`` command line.

Each command group lives in its own module and registers its subcommands on
the shared parser; ``main`` dispatches. Exit codes are part of the contract
(see :mod:`meshnode.cli.exitcodes`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meshnode import __version__

from .exitcodes import EX_USAGE


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top, so that importing ``meshnode.cli`` (or one of
    # its modules) alone does not pull in every command module.
    from . import a2a, artifacts, daemon, envelope, inbox, mesh, ops

    parser = argparse.ArgumentParser(
        prog="meshnode",
        description="The AgentMesh node daemon and its tools.",
    )
    parser.add_argument("--version", action="version", version=f"meshnode {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    daemon.register(commands)
    envelope.register(commands)
    mesh.register(commands)
    inbox.register(commands)
    ops.register(commands)
    artifacts.register(commands)
    a2a.register(commands)
    _plugin_commands(commands)
    return parser


def _plugin_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Let installed plugins add subcommands (hook ``meshnode_add_cli_commands``)."""
    import logging

    from meshnode.plugins import load_plugins

    try:
        pm, _ = load_plugins()
        pm.add_cli_commands(commands)
    except Exception as exc:  # a broken plugin must not break the CLI
        logging.getLogger("meshnode.cli").warning("plugin CLI commands unavailable: %s", exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EX_USAGE
    try:
        result: int = handler(args)
    except BrokenPipeError:
        # The reader went away (`meshnode ... | head`): not an error worth a traceback.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return result


if __name__ == "__main__":
    raise SystemExit(main())
