"""``meshnode new-agent NAME``: a runnable plugin package to start from.

It writes ``NAME/pyproject.toml`` (``[build-system]``, ``[project]`` and the
``meshnode.agents`` entry point), ``NAME/<module>/__init__.py`` (an ``Agent``
with its ``Settings`` and one offering) and ``NAME/tests/test_<module>.py``,
which hosts the agent on a real daemon with :mod:`meshnode.testing` and calls
it. ``pip install -e NAME`` installs it; ``meshnode reload`` (or a start) hosts
it once a node's configuration names it in an ``[agents.<x>]`` table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .exitcodes import EX_CANTCREAT, EX_OK, EX_USAGE
from .output import emit_json

__all__ = ["register", "render_package"]

#: An agent kind: the entry-point name and the default [agents.<name>] table.
_NAME = re.compile(r"[a-z][a-z0-9-]{0,62}")

_PYPROJECT = '''\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A meshnode agent: {name}"
requires-python = ">=3.11"
dependencies = ["meshnode"]

[project.entry-points."meshnode.agents"]
{name} = "{module}:{cls}"

[tool.setuptools]
packages = ["{module}"]
'''

_MODULE = '''\
"""The {name} agent (a meshnode plugin)."""

from meshnode.agent import Agent, AgentSettings, Context, Refusal, offering


class {cls}Settings(AgentSettings):
    """The keys of its [agents.<name>] table (unknown keys are refused)."""

    greeting: str = "hello"


class {cls}(Agent):
    description = "Greets whoever asks."
    capabilities = ["{name}"]
    Settings = {cls}Settings

    @offering("hello", description="Greets by name", framing=False,
              input_schema={{"type": "object", "required": ["name"],
                            "properties": {{"name": {{"type": "string"}}}}}})
    async def hello(self, ctx: Context, input: dict) -> dict:
        if not input["name"].strip():
            raise Refusal("INPUT_INVALID", "name must not be blank")
        return {{"text": f"{{self.settings.greeting}}, {{input['name']}}"}}
'''

_TEST = '''\
"""{name} on a real daemon and a real embedded mesh (meshnode.testing).

Run with `pip install -e .` done, then `pytest`.
"""

from meshnode.testing import DaemonSet


def test_hello(meshnode_daemons: DaemonSet) -> None:
    node = meshnode_daemons.embedded("{name}-test", agents={{"{name}": {{"plugin": "{name}", "greeting": "hi"}}}})
    result = node.call("{name}", "hello", {{"name": "Ada"}})
    assert result["status"] == "completed", result
    assert result["output"] == {{"text": "hi, Ada"}}
    refused = node.call("{name}", "hello", {{"name": " "}})
    assert refused["error"]["code"] == "INPUT_INVALID", refused
'''


def register(commands: Any) -> None:
    p = commands.add_parser(
        "new-agent",
        help="write a runnable plugin package (pyproject, an agent with one offering, a test)",
    )
    p.add_argument("name", help="the agent kind: the entry-point name a node's [agents.X] plugin = names")
    p.add_argument("--dir", default=".", help="where the package directory NAME/ is created (default: here)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_new_agent)


def render_package(name: str) -> dict[str, str]:
    """The package's files, by path relative to its directory."""
    module = name.replace("-", "_")
    cls = "".join(part.capitalize() for part in name.split("-"))
    values = {"name": name, "dist": f"meshnode-{name}" if not name.startswith("meshnode") else name,
              "module": module, "cls": cls}
    return {
        "pyproject.toml": _PYPROJECT.format(**values),
        f"{module}/__init__.py": _MODULE.format(**values),
        f"tests/test_{module}.py": _TEST.format(**values),
    }


def cmd_new_agent(args: argparse.Namespace) -> int:
    name = args.name
    if not _NAME.fullmatch(name):
        print(f"meshnode: agent name {name!r}: use lower-case letters, digits and '-', starting with a letter",
              file=sys.stderr)
        return EX_USAGE
    root = Path(args.dir) / name
    if root.exists():
        print(f"meshnode: {root} exists; choose another name or --dir (nothing was written)", file=sys.stderr)
        return EX_CANTCREAT
    files = render_package(name)
    try:
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"meshnode: cannot write {root}: {exc.strerror or exc}", file=sys.stderr)
        return EX_CANTCREAT
    written = [str(root / rel) for rel in files]
    if args.json:
        emit_json({"package": str(root), "files": written, "entry_point": name})
        return EX_OK
    for path in written:
        print(f"wrote {path}")
    table = json.dumps(name)
    print(f"""
Next:
  pip install -e {root}          # into meshnode's environment
  (cd {root} && pytest)          # its test hosts it on a real daemon
  # host it: add to the node's configuration, then `meshnode reload`
  [agents.{name}]
  plugin = {table}
  greeting = "welcome\"""")
    return EX_OK
