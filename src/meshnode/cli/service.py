"""``meshnode install-service``: systemd units with this installation's real paths.

A unit names its binary by absolute path and, for the system service, runs as
the ``meshnode`` user; neither can be known when the repository is written
(a virtualenv, pipx, /usr/local). So the units are generated here, from one
template per kind, with the path of the ``meshnode`` that runs this command,
and the system user is created when missing. ``systemd/*.service`` in the
repository are this command's output for ``/usr/local/bin/meshnode`` (a unit
test keeps them equal), and every generated unit passes
``systemd-analyze verify`` (an integration test runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .exitcodes import EX_CANTCREAT, EX_NOPERM, EX_OK, EX_TEMPFAIL, EX_USAGE

SERVICE_USER = "meshnode"
#: The first line of the repository's copies in systemd/ (the rest is generated).
REFERENCE_HEADER = (
    "# Reference copy: `meshnode install-service` writes this unit with the real path of your\n"
    "# meshnode (here {binary}) and creates the meshnode user; prefer it to copying this file.\n"
)
SYSTEM_CONFIG = "/etc/meshnode/meshnode.toml"

_SYSTEM_UNIT = """\
# meshnode as a system service; written by `meshnode install-service`.
# Then: sudo install -d -m 0750 -o root -g {user} /etc/meshnode
#       sudo cp config/meshnode.toml {config}   # or write your own
#       sudo systemctl daemon-reload && sudo systemctl enable --now meshnode
[Unit]
Description=meshnode - AgentMesh node daemon
Documentation=https://github.com/meshnode/meshnode
After=network-online.target
Wants=network-online.target

[Service]
# Type=notify-reload (systemd >= 253) also works: the daemon sends RELOADING=1/READY=1.
Type=notify
NotifyAccess=main
ExecReload=/bin/kill -HUP $MAINPID
ExecStart={binary} run --config {config}
ExecStartPre={binary} check-config --config {config}
# A bad configuration exits 78: do not restart-loop on it.
RestartPreventExitStatus=78
Restart=on-failure
RestartSec=5s
WatchdogSec=60s
# The daemon's shutdown stages sum to 32 s (meshnode.daemon.lifecycle); keep margin.
TimeoutStopSec=45s
TimeoutStartSec=120s

User={user}
Group={user}
StateDirectory=meshnode
StateDirectoryMode=0700
RuntimeDirectory=meshnode
RuntimeDirectoryMode=0750
ConfigurationDirectory=meshnode
# The node key from systemd credentials (optional; see docs/operations/security.md, "Keys at rest"):
# LoadCredentialEncrypted=node:/etc/meshnode/node.cred

# Hardening
NoNewPrivileges=yes
ProtectSystem=strict
{protect_home}
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictNamespaces=yes
LockPersonality=yes
MemoryDenyWriteExecute=no
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
CapabilityBoundingSet=
AmbientCapabilities=
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources
UMask=0077

[Install]
WantedBy=multi-user.target
"""

_USER_UNIT = """\
# meshnode as a user service (a laptop); written by `meshnode install-service --user`.
# The configuration at {config}; keys and data where it says (by default your
# keyring or ~/.local/share/meshnode).
# Then: systemctl --user daemon-reload && systemctl --user enable --now meshnode
#       loginctl enable-linger "$USER"   # keep it running while you are logged out
[Unit]
Description=meshnode - AgentMesh node daemon (user)
Documentation=https://github.com/meshnode/meshnode

[Service]
Type=notify
ExecStartPre={binary} check-config{config_arg}
ExecStart={binary} run{config_arg}
ExecReload=/bin/kill -HUP $MAINPID
RestartPreventExitStatus=78
Restart=on-failure
RestartSec=5s
WatchdogSec=60s
TimeoutStopSec=45s
NoNewPrivileges=yes
UMask=0077

[Install]
WantedBy=default.target
"""

_HOME_HIDDEN = "ProtectHome=yes"
# A binary in a virtualenv under /home (or /root) must stay visible to the service.
_HOME_VISIBLE = (
    "# meshnode (or its Python) lives under a home directory: readable, not hidden.\n"
    "ProtectHome=read-only"
)


_HOMES = ("/home", "/root", "/run/user")


def _under_home(path: str) -> bool:
    return any(path == h or path.startswith(h + "/") for h in _HOMES)


def runs_from_home(binary: str) -> bool:
    """Whether running ``binary`` touches a home directory: the path itself, the
    file it links to, or its script's interpreter (a virtualenv's python is
    often a link into ~/.pyenv or /root/.pyenv), each followed to the real file."""
    paths = [binary, os.path.realpath(binary)]
    try:
        with open(binary, "rb") as handle:
            first = handle.readline(512)
    except OSError:
        first = b""
    if first.startswith(b"#!"):
        words = first[2:].decode("utf-8", "replace").split()
        if words:
            paths += [words[0], os.path.realpath(words[0])]
    return any(_under_home(p) for p in paths)


def system_unit(binary: str, config: str = SYSTEM_CONFIG, user: str = SERVICE_USER,
                *, home_visible: bool | None = None) -> str:
    """The system unit for ``binary`` (an absolute path). ``home_visible``
    (default: :func:`runs_from_home`) gives ``ProtectHome=read-only`` instead of
    ``yes``, so a binary or interpreter under a home directory can still run."""
    visible = runs_from_home(binary) if home_visible is None else home_visible
    return _SYSTEM_UNIT.format(
        binary=binary, config=config, user=user, protect_home=_HOME_VISIBLE if visible else _HOME_HIDDEN
    )


def user_unit(binary: str, config: str | None = None) -> str:
    """The user unit for ``binary``; ``config`` None: the default location."""
    return _USER_UNIT.format(
        binary=binary,
        config=config or "~/.config/meshnode/meshnode.toml",
        config_arg=f" --config {config}" if config else "",
    )


def default_binary() -> str | None:
    """The ``meshnode`` of this installation: beside the running interpreter
    (a virtualenv's bin/), else the one on PATH; absolute, symlinks kept (a
    venv's entry point is the stable name)."""
    beside = Path(sys.executable).with_name("meshnode")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.absolute())
    found = shutil.which("meshnode")
    return str(Path(found).absolute()) if found else None


def register(commands: Any) -> None:
    p = commands.add_parser(
        "install-service",
        help="write a systemd unit with this installation's meshnode path (and create the meshnode user)",
        description="Write meshnode.service for systemd with the absolute path of this meshnode, "
        "so the unit passes `systemd-analyze verify`. The system unit runs as the user "
        f"{SERVICE_USER!r}, created (a system user, no login) when missing; --user writes a "
        "user unit instead. Nothing is enabled or started: the command prints what to run next.",
    )
    p.add_argument("--user", action="store_true", dest="user_unit",
                   help="a user unit (~/.config/systemd/user) instead of the system unit")
    p.add_argument("--dir", help="where to write the unit (default /etc/systemd/system, "
                   "or ~/.config/systemd/user with --user)")
    p.add_argument("--binary", help="the meshnode executable to run (default: this installation's)")
    p.add_argument("--config", "-c", dest="service_config",
                   help=f"the configuration the service runs with (default {SYSTEM_CONFIG}; "
                   "with --user the default location)")
    p.add_argument("--no-create-user", action="store_true",
                   help=f"do not create the {SERVICE_USER!r} system user (it must exist when the unit starts)")
    p.add_argument("--force", action="store_true", help="replace a different unit already there")
    p.add_argument("--dry-run", action="store_true", help="print the unit and what would be done; change nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_install_service)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _create_user_command(name: str) -> list[str]:
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    nologin = next((p for p in ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false") if os.path.exists(p)), "/bin/false")
    return [useradd, "--system", "--user-group", "--no-create-home",
            "--home-dir", "/var/lib/meshnode", "--shell", nologin, name]


def cmd_install_service(args: argparse.Namespace) -> int:
    binary = args.binary or default_binary()
    if binary is None:
        print("meshnode: cannot tell where the meshnode executable is; pass --binary PATH", file=sys.stderr)
        return EX_USAGE
    if not os.path.isabs(binary):
        print(f"meshnode: --binary must be an absolute path (systemd wants one), got {binary!r}", file=sys.stderr)
        return EX_USAGE
    if args.user_unit:
        text = user_unit(binary, args.service_config)
        directory = Path(args.dir).expanduser() if args.dir else Path.home() / ".config" / "systemd" / "user"
    else:
        text = system_unit(binary, args.service_config or SYSTEM_CONFIG)
        directory = Path(args.dir) if args.dir else Path("/etc/systemd/system")
    unit = directory / "meshnode.service"
    if not args.user_unit and runs_from_home(binary):
        # ProtectHome=read-only keeps it visible; ordinary permissions still apply.
        print(f"meshnode: note: {binary} (or its Python) is under a home directory: the {SERVICE_USER} "
              "user must be able to read it (a 0700 home is not); for a system service prefer an "
              "install outside /home and /root (e.g. a virtualenv in /opt/meshnode)", file=sys.stderr)
    create_user = None
    if not args.user_unit and not args.no_create_user and not _user_exists(SERVICE_USER):
        create_user = _create_user_command(SERVICE_USER)
    plan: dict[str, Any] = {
        "unit": str(unit), "binary": binary, "create_user": create_user,
        "next": (["systemctl --user daemon-reload", "systemctl --user enable --now meshnode"] if args.user_unit
                 else ["systemctl daemon-reload", "systemctl enable --now meshnode"]),
    }
    if args.dry_run:
        if args.json:
            print(json.dumps({**plan, "dry_run": True, "text": text}))
        else:
            print(f"# would write {unit}:")
            print(text, end="")
            if create_user:
                print(f"# would create the {SERVICE_USER} user: {' '.join(create_user)}")
        return EX_OK

    try:
        current = unit.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    except OSError as exc:
        print(f"meshnode: cannot read {unit}: {exc.strerror}", file=sys.stderr)
        return EX_CANTCREAT
    if current is not None and current != text and not args.force:
        print(f"meshnode: {unit} exists and differs; not overwriting it (--force replaces it, "
              f"--dry-run shows the new text)", file=sys.stderr)
        return EX_CANTCREAT
    if create_user:
        if os.geteuid() != 0:
            print(f"meshnode: the system unit runs as the {SERVICE_USER!r} user, which does not exist, and "
                  "creating it needs root: re-run with sudo, or create it yourself and pass --no-create-user "
                  "(--user writes a unit for your own account instead)", file=sys.stderr)
            return EX_NOPERM
        proc = subprocess.run(create_user, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"meshnode: {' '.join(create_user)} failed: {proc.stderr.strip()}", file=sys.stderr)
            return EX_TEMPFAIL
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = unit.with_name(f".{unit.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, unit)
    except OSError as exc:
        hint = " (the system unit directory needs root: sudo, or --user, or --dir)" if exc.errno == 13 else ""
        print(f"meshnode: cannot write {unit}: {exc.strerror}{hint}", file=sys.stderr)
        return EX_NOPERM if exc.errno == 13 else EX_CANTCREAT
    if args.json:
        print(json.dumps(plan))
    else:
        print(f"wrote {unit} (runs {binary})")
        if create_user:
            print(f"created the system user {SERVICE_USER}")
        print("next: " + " && ".join(plan["next"]))
    return EX_OK
