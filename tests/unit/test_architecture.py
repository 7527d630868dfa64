"""The layer contract of docs/architecture.md, checked on the source tree.

An import-linter style contract, written here so it runs with the unit tests and
needs no extra tool. It reads every module under ``src/meshnode`` with ``ast``
(nothing is imported) and checks:

* each top-level part of the package imports only the parts below it
  (``ALLOWED``);
* ``node/`` and ``services/`` import no ``nats`` (NATS lives in ``transport/``);
* nothing below the gateways imports ``meshnode.a2a`` or the ``a2a`` SDK;
* no function-local import of a ``meshnode`` module (they hide import cycles);
  imports under ``if TYPE_CHECKING:`` are fine, and so are function-local
  imports of optional third-party extras (a2a-sdk, uvicorn, opentelemetry) and,
  in the daemon, of the A2A gateway modules that need one (``LAZY_EXTRA_GATEWAYS``);
* ``meshnode run`` without A2A does not load the a2a-sdk (checked in a subprocess).

``KNOWN_VIOLATIONS`` lists what the tree still does wrong while the redesign of
issue #16 lands; it may only shrink, and the last test fails when an entry no
longer occurs (so a fixed violation is struck from the list in the same change).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshnode"

# Which top-level parts of meshnode each part may import (besides itself).
# Read bottom-up: protocol is pure; transport binds NATS; config and keystore
# are settings and secrets; agent/plugins are the plugin author's API; node is
# the runtime; services are service-role agents; control_plane is the
# enrolment HTTP service of an embedded mesh; a2a is a gateway; admin is the
# socket protocol, server and client; daemon wires everything; cli and testing
# sit on top.
# aio (meshnode/aio.py: BackgroundTasks, backoff) is a leaf like protocol, importing
# nothing of meshnode; unlike protocol it is about asyncio, so it is its own part.
# pages (meshnode/pages.py: a long list answered in pages within a reply's size)
# is a leaf too, used by the services and the daemon's admin methods alike.
_BASE = {"protocol", "aio", "pages"}
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "aio": set(),
    "pages": set(),
    "transport": _BASE,
    "config": _BASE,
    "keystore": _BASE | {"config"},
    "agent": _BASE,
    "plugins": _BASE | {"agent"},
    "observability": _BASE | {"agent", "plugins", "config"},
    "node": _BASE | {"transport", "config", "keystore", "agent", "plugins", "observability"},
    "services": _BASE | {"transport", "config", "keystore", "agent", "plugins", "node"},
    "control_plane": _BASE | {"transport", "config", "keystore"},
    "a2a": _BASE | {"transport", "config", "keystore", "agent", "plugins", "node"},
    "admin": _BASE | {"config"},
    "daemon": _BASE
    | {
        "transport",
        "config",
        "keystore",
        "agent",
        "plugins",
        "observability",
        "node",
        "services",
        "control_plane",
        "a2a",
        "admin",
    },
}
# cli and testing stand on everything below them.
ALLOWED["cli"] = ALLOWED["daemon"] | {"daemon"}
ALLOWED["testing"] = ALLOWED["daemon"] | {"daemon"}
ALLOWED["__init__"] = set()
ALLOWED["__main__"] = {"cli"}

NO_NATS = {"node", "services"}
BELOW_GATEWAYS = {
    "protocol",
    "aio",
    "pages",
    "transport",
    "config",
    "keystore",
    "agent",
    "plugins",
    "observability",
    "node",
    "services",
}
# The CLI imports each subcommand's machinery lazily so that `meshnode status`
# does not load the daemon, NATS and pydantic: start-up time, not a cycle.
LAZY_IMPORTS_ALLOWED = {"cli"}
# The gateway modules that need the optional a2a-sdk extra, imported by the
# daemon only when A2A is configured: loading the SDK cost every `meshnode run`
# without A2A ~0.3 s of its start (issue #21). Start-up time, not a cycle.
LAZY_EXTRA_GATEWAYS = {"meshnode.a2a.outbound", "meshnode.a2a.server"}

# (module, rule, imported) triples still to be fixed by issue #16. Only shrinks.
KNOWN_VIOLATIONS: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted (absolute)
    local: bool  # inside a function body
    type_only: bool  # under ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[Import]:
    module = _module_name(path)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, alias.name, local, type_only))
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, is_package, child)
                found.append(Import(module, target, local, type_only))
                if child.module is None:  # from . import x: each x is a module
                    for alias in child.names:
                        found.append(Import(module, f"{target}.{alias.name}", local, type_only))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, type_only)
            else:
                visit(child, local, type_only)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False, False)
    return found


def _part(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _violations() -> set[tuple[str, str, str]]:
    out: set[tuple[str, str, str]] = set()
    for path in sorted(SRC.rglob("*.py")):
        for imp in _imports(path):
            part = _part(imp.module)
            top = imp.target.split(".")[0]
            if top == "meshnode":
                target_part = _part(imp.target)
                lazy_ok = part in LAZY_IMPORTS_ALLOWED or (part == "daemon" and imp.target in LAZY_EXTRA_GATEWAYS)
                if imp.local and not imp.type_only and not lazy_ok:
                    out.add((imp.module, "function-local", imp.target))
                if imp.type_only or target_part in (part, "__init__"):
                    continue
                if target_part not in ALLOWED.get(part, set()):
                    out.add((imp.module, "layer", imp.target))
                if part in BELOW_GATEWAYS and target_part == "a2a":
                    out.add((imp.module, "a2a-below-gateways", imp.target))
            elif top == "nats" and part in NO_NATS:
                out.add((imp.module, "nats-outside-transport", imp.target))
            elif top == "a2a" and part in BELOW_GATEWAYS:
                out.add((imp.module, "a2a-below-gateways", imp.target))
    return out


def test_every_part_has_a_rule() -> None:
    parts = {_part(_module_name(p)) for p in SRC.rglob("*.py")}
    assert parts <= set(ALLOWED), f"add a layer rule for {sorted(parts - set(ALLOWED))}"


def test_layer_contract_holds() -> None:
    new = sorted(_violations() - KNOWN_VIOLATIONS)
    assert not new, "imports that break the layer contract:\n" + "\n".join(
        f"  {m}: {rule} import of {t}" for m, rule, t in new
    )


def test_known_violations_only_shrink() -> None:
    fixed = sorted(KNOWN_VIOLATIONS - _violations())
    assert not fixed, "fixed, strike from KNOWN_VIOLATIONS:\n" + "\n".join(f"  {v}" for v in fixed)


def _loaded_by(statements: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of ``packages`` (each package or anything inside it) that a
    fresh interpreter has loaded after building the CLI parser and running
    ``statements``."""
    probe = (
        "import sys\n"
        "from meshnode.cli import build_parser\n"
        "build_parser()\n"
        f"{statements}\n"
        f"packages = {packages!r}\n"
        "print('\\n'.join(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in packages))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_a_node_without_a2a_does_not_load_the_sdk() -> None:
    """What `meshnode run` imports before it reads its configuration (the CLI
    parser and the daemon) loads none of the a2a-sdk: it is loaded only when
    ``[a2a]`` asks for a gateway."""
    loaded = _loaded_by("import meshnode.daemon.main", ("a2a",))
    assert loaded == [], f"the run path loads the a2a-sdk: {loaded[:20]}"


def test_the_cli_parser_loads_neither_nats_nor_the_node_runtime() -> None:
    """Every CLI command builds the whole parser first, so what it imports is
    every command's start-up time: the daemon, the node runtime and NATS load
    only in the commands that use them (`meshnode status` took 0.84 s, 0.27 s now)."""
    loaded = _loaded_by("", ("nats", "meshnode.node", "meshnode.daemon"))
    assert loaded == [], f"the CLI parser loads: {loaded[:20]}"
