"""The ``meshnode`` command line.

Each command group lives in its own module and registers its subcommands on
the shared parser; ``main`` dispatches. Exit codes are part of the contract
(the table is in :mod:`meshnode.cli.exitcodes`); ``--json`` and time formats
follow :mod:`meshnode.cli.output`; every command's ``--help`` ends with an
example (:data:`EXAMPLES`); ``meshnode completion SHELL`` is generated from
this parser.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from meshnode import __version__

from .exitcodes import EX_USAGE

#: The example each command's ``--help`` ends with (command path -> lines).
#: A command not listed (a plugin's) gets one made from its usage.
EXAMPLES: dict[str, list[str]] = {
    "run": ["meshnode run --config /etc/meshnode/meshnode.toml"],
    "check-config": ["meshnode check-config --config meshnode.toml --json"],
    "status": ["meshnode status", "meshnode status --brief --json"],
    "call": ["meshnode call echo echo --text hello",
             "meshnode call wordstream words --text 'one two three' --stream",
             "meshnode call longtask count '{\"to\": 5}' --no-wait",
             "meshnode call summarizer summarize --text - < report.txt"],
    "envelope canonical": ["echo '{\"b\": 1, \"a\": 2}' | meshnode envelope canonical"],
    "envelope verify": ["meshnode envelope verify --json < envelope.json"],
    "envelope sign": ["meshnode envelope sign --seed-file agent.json < envelope.json"],
    "envelope keygen": ["meshnode envelope keygen --out agent.json"],
    "mesh info": ["meshnode mesh info --json"],
    "mesh nodes": ["meshnode mesh nodes"],
    "mesh invite": ["meshnode mesh invite laptop --out laptop.creds"],
    "mesh retire": ["meshnode mesh retire --node UABC..."],
    "join": [
        "meshnode join laptop.creds --data-dir ~/.local/share/meshnode --agent echo",
        "meshnode join laptop.creds --data-dir ~/.local/share/meshnode --force  # keeps a .bak",
        "meshnode join node.creds --server nats://mesh.example.org:4222 --data-dir ~/.local/share/meshnode",
    ],
    "inbox list": ["meshnode inbox list --all"],
    "inbox show": ["meshnode inbox show 12"],
    "inbox reply": ["meshnode inbox reply 12 --text 'yes, go ahead'"],
    "inbox ack": ["meshnode inbox ack 12"],
    "agents list": ["meshnode agents list --json"],
    "agents show": ["meshnode agents show echo"],
    "agents add": ["meshnode agents add echo2 --plugin echo --set greeting='\"hi\"' --save",
                   "meshnode agents add worker1 worker2 worker3 --plugin echo --save"],
    "agents remove": ["meshnode agents remove echo2", "meshnode agents remove worker1 worker2 worker3"],
    "agents restart": ["meshnode agents restart echo"],
    "presence": ["meshnode presence --agent UABC... --json"],
    "discover": ["meshnode discover --offering echo --availability online"],
    "drain": ["meshnode drain --agent echo"],
    "renew": ["meshnode renew"],
    "reload": ["meshnode reload"],
    "logs": ["meshnode logs --follow --level warning"],
    "tasks list": ["meshnode tasks list"],
    "tasks show": ["meshnode tasks show t01HZX... --json"],
    "tasks cancel": ["meshnode tasks cancel t01HZX... --reason superseded"],
    "metrics": ["meshnode metrics --prometheus"],
    "artifacts put": ["meshnode artifacts put report.pdf --retention 30d"],
    "artifacts get": ["meshnode artifacts get mesh:artifacts:... --out report.pdf"],
    "artifacts stat": ["meshnode artifacts stat mesh:artifacts:..."],
    "artifacts rm": ["meshnode artifacts rm mesh:artifacts:..."],
    "artifacts usage": ["meshnode artifacts usage"],
    "a2a charges": ["meshnode a2a charges --peer travel"],
    "agreements sign": ["meshnode agreements sign summarizer --offering summarize",
                        "meshnode agreements sign Uabc... --sku caselaw-metered --out agreement.json"],
    "agreements add": ["meshnode agreements add agreement.json"],
    "agreements list": ["meshnode agreements list --json"],
    "usage": ["meshnode usage --charges", "meshnode usage --owner Uowner... --json"],
    "agreements revoke": ["meshnode agreements revoke caselaw-metered --owner Uowner..."],
    "allowance set": ["meshnode allowance set summarizer --per-task 500000 --per-day 10000000 --cost-model 1500:USD",
                      "meshnode allowance set summarizer --per-day 20000000 --on-exhaustion ask_owner"],
    "allowance show": ["meshnode allowance show summarizer --json"],
    "allowance clear": ["meshnode allowance clear summarizer"],
    "allowance decline": ["meshnode allowance decline summarizer --task t01HZX..."],
    "pub": ["meshnode pub billing invoice_ready '{\"invoice\": 42}'"],
    "sub": ["meshnode sub 'billing.*' --json", "meshnode sub --feed echo --count 1"],
    "new-agent": ["meshnode new-agent greeter --dir ~/src && pip install -e ~/src/greeter"],
    "install-service": ["sudo .venv/bin/meshnode install-service",
                        "meshnode install-service --user --dry-run"],
    "completion": ["meshnode completion bash > ~/.local/share/bash-completion/completions/meshnode"],
}


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's exit code for a wrong command line (64, not 2)
    and examples kept as written."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost parser that was left words over is the command they were
        # given to: it, not ``meshnode``, reports them (with its own usage).
        if extras and not hasattr(parsed, "_unrecognized_by"):
            parsed._unrecognized_by = self
        return parsed, extras

    def unrecognized(self, extras: list[str]) -> NoReturn:
        """Refuse words this command does not take, naming a close option."""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        hints = []
        for word in extras:
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.7) \
                if word.startswith("--") else []
            if close:
                hints.append(f"{word.split('=', 1)[0]}: did you mean {close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def build_parser() -> Parser:
    # Imported here, not at the top, so that importing ``meshnode.cli`` (or one of
    # its modules) alone does not pull in every command module.
    from . import (
        a2a,
        agreements,
        allowance,
        artifacts,
        completion,
        daemon,
        envelope,
        events,
        inbox,
        mesh,
        ops,
        scaffold,
        service,
    )

    parser = Parser(
        prog="meshnode",
        description="The AgentMesh node daemon and its tools.",
        epilog="Example:\n  meshnode status\n\nEach command has --help with an example.",
    )
    parser.add_argument("--version", action="version", version=f"meshnode {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    daemon.register(commands)
    envelope.register(commands)
    mesh.register(commands)
    inbox.register(commands)
    ops.register(commands)
    artifacts.register(commands)
    a2a.register(commands)
    agreements.register(commands)
    agreements.register_usage(commands)
    allowance.register(commands)
    events.register(commands)
    scaffold.register(commands)
    service.register(commands)
    completion.register(commands)
    _plugin_commands(commands)
    completion.attach(parser, commands)
    _add_examples(parser)
    return parser


def _add_examples(parser: argparse.ArgumentParser, path: str = "") -> None:
    """End every command's help with its example (:data:`EXAMPLES`)."""
    children = _subcommands(parser)
    for name, sub in children.items():
        _add_examples(sub, f"{path} {name}".strip())
    if not path:
        return
    lines = EXAMPLES.get(path) or [_made_example(parser, path, children)]
    example = "Example:\n" + "\n".join(f"  {line}" for line in lines)
    parser.epilog = f"{parser.epilog}\n\n{example}" if parser.epilog else example
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _made_example(parser: argparse.ArgumentParser, path: str, children: dict[str, argparse.ArgumentParser]) -> str:
    """An example for a command without one (a plugin's): its required arguments."""
    if children:
        return f"meshnode {path} {next(iter(children))} --help"
    required = [
        str(a.metavar or a.dest.upper()) for a in parser._actions
        if not a.option_strings and a.nargs not in ("?", "*")
    ]
    return " ".join(["meshnode", path, *required])


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _plugin_commands(commands: Any) -> None:
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
    args, extras = parser.parse_known_args(argv)
    if extras:
        leaf: Parser = getattr(args, "_unrecognized_by", parser)
        leaf.unrecognized(extras)
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
