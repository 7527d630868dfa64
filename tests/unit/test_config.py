"""meshnode.config: loading, defaults, validation messages."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from meshnode.config import (
    EX_CONFIG,
    UDS_PATH_MAX,
    AgentConfig,
    Config,
    ConfigError,
    describe_sources,
    format_duration,
    format_size,
    is_system_service,
    load_config,
    parse_duration,
    parse_size,
    resolve_config_path,
)

USER = 1000


def user_env(short_tmp_path: Path, **extra: str) -> dict[str, str]:
    """A desktop-user environment rooted in a short temporary path (the default
    admin socket goes under HOME, and socket paths are limited), nothing systemd-ish."""
    return {"HOME": str(short_tmp_path / "home"), **extra}


def write(short_tmp_path: Path, text: str, name: str = "meshnode.toml") -> Path:
    path = short_tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_text(short_tmp_path: Path, text: str, **env: str) -> Config:
    return load_config(str(write(short_tmp_path, text)), env=user_env(short_tmp_path, **env), euid=USER)


def problems_of(short_tmp_path: Path, text: str, **env: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_text(short_tmp_path, text, **env)
    return str(info.value).splitlines()


# ---------------------------------------------------------------- defaults


def test_ex_config_is_sysexits_value() -> None:
    assert EX_CONFIG == 78


def test_defaults_without_a_file(short_tmp_path: Path) -> None:
    config = load_config(env=user_env(short_tmp_path), euid=USER)
    home = short_tmp_path / "home"
    assert config.source_file is None
    assert config.node.name == socket.gethostname()
    assert config.node.data_dir == home / ".local/share/meshnode"
    assert config.node.availability_class is None
    assert config.node.vouch_ttl is None
    assert config.node.heartbeat_interval == timedelta(seconds=30)
    assert config.node.strict_plugins is False
    assert config.mesh.servers == []
    assert config.mesh.is_embedded
    assert config.mesh.credentials is None
    assert config.mesh.control_plane is None
    emb = config.mesh.embedded
    assert (emb.host, emb.port, emb.control_host, emb.control_port) == (
        "127.0.0.1",
        4222,
        "127.0.0.1",
        7422,
    )
    assert emb.max_payload == 1024**2
    assert emb.jetstream_max_store == 4 * 1024**3
    assert emb.account_max_store is None
    assert emb.credential_ttl == timedelta(hours=24)
    assert emb.monitor_port is None  # unauthenticated monitoring is off unless asked for
    assert config.registry.require_connection_bound is True
    assert config.admin.socket == home / ".local/share/meshnode/admin.sock"
    assert config.admin.group is None
    assert config.admin.mode is None
    assert config.admin.effective_mode == 0o600
    p = config.protections
    assert p.max_inbound_chars == 65536
    assert p.clock_skew_ahead == timedelta(minutes=5)
    assert p.live_max_age == timedelta(minutes=10)
    assert p.mailbox_max_age == timedelta(days=7)
    assert p.dedup_entries == 5000
    assert config.inbox.drain_interval == timedelta(seconds=60)
    assert config.inbox.buffer_max_age == timedelta(days=7)
    assert config.inbox.buffer_max_bytes == 8 * 1024**2
    assert config.inbox.buffer_max_msgs == 2000
    assert config.storage.tasks_max_bytes == 64 * 1024**2
    assert config.keystore.backend == "auto"
    assert config.logging.level == "info"
    assert config.logging.format == "auto"
    assert config.agents == {}


def test_empty_file_is_all_defaults(short_tmp_path: Path) -> None:
    config = load_text(short_tmp_path, "")
    assert config.source_file == short_tmp_path / "meshnode.toml"
    assert config.to_toml_dict() == load_config(env=user_env(short_tmp_path), euid=USER).to_toml_dict()


def test_user_defaults_follow_xdg(short_tmp_path: Path) -> None:
    env = user_env(
        short_tmp_path,
        XDG_CONFIG_HOME=str(short_tmp_path / "cfg"),
        XDG_DATA_HOME=str(short_tmp_path / "data"),
        XDG_RUNTIME_DIR=str(short_tmp_path / "run"),
    )
    assert resolve_config_path(env=env, euid=USER) == (
        short_tmp_path / "cfg/meshnode/meshnode.toml",
        "default location",
        False,
    )
    config = load_config(env=env, euid=USER)
    assert config.node.data_dir == short_tmp_path / "data/meshnode"
    assert config.admin.socket == short_tmp_path / "run/meshnode/admin.sock"


def test_relative_xdg_values_are_ignored(short_tmp_path: Path) -> None:
    config = load_config(env=user_env(short_tmp_path, XDG_DATA_HOME="rel/data"), euid=USER)
    assert config.node.data_dir == short_tmp_path / "home/.local/share/meshnode"


def test_systemd_system_service_defaults(short_tmp_path: Path) -> None:
    env = {
        "INVOCATION_ID": "abc",
        "STATE_DIRECTORY": str(short_tmp_path / "state") + ":/var/lib/other",
        "RUNTIME_DIRECTORY": str(short_tmp_path / "rt"),
    }
    assert is_system_service(env, euid=999)
    path, _, explicit = resolve_config_path(env=env, euid=999)
    assert path == Path("/etc/meshnode/meshnode.toml")
    assert not explicit
    config = load_config(env=env, euid=999)
    assert config.node.data_dir == short_tmp_path / "state"
    assert config.admin.socket == short_tmp_path / "rt/admin.sock"


def test_configuration_directory_wins_for_the_default_path(short_tmp_path: Path) -> None:
    env = {"INVOCATION_ID": "x", "CONFIGURATION_DIRECTORY": str(short_tmp_path / "etc")}
    (short_tmp_path / "etc").mkdir()
    write(short_tmp_path, "", name="etc/meshnode.toml")
    path, origin, explicit = resolve_config_path(env=env, euid=999)
    assert (path, origin, explicit) == (short_tmp_path / "etc/meshnode.toml", "default location", False)
    assert load_config(env=env, euid=999).source_file == path


def test_root_without_systemd(short_tmp_path: Path) -> None:
    env = {"HOME": "/root"}
    assert is_system_service(env, euid=0)
    assert resolve_config_path(env=env, euid=0)[0] == Path("/etc/meshnode/meshnode.toml")
    config = load_config(env=env, euid=0)
    assert config.node.data_dir == Path("/var/lib/meshnode")
    assert config.admin.socket == Path("/var/lib/meshnode/admin.sock")


def test_user_service_is_not_a_system_service(short_tmp_path: Path) -> None:
    env = {"INVOCATION_ID": "x", "XDG_RUNTIME_DIR": "/run/user/1000", "HOME": "/home/u"}
    assert not is_system_service(env, euid=USER)
    assert resolve_config_path(env=env, euid=USER)[0] == Path(
        "/home/u/.config/meshnode/meshnode.toml"
    )


# ---------------------------------------------------------------- every key

FULL = """
[node]
name = "laptop"
data_dir = "/srv/mesh"
availability_class = "always_on"
vouch_ttl = "72h"
heartbeat_interval = "15s"
strict_plugins = true

[mesh]
servers = ["nats://a.example:4222", "tls://b.example:4443"]
credentials = "/etc/meshnode/node.creds"
control_plane = "https://cp.example/api"

[mesh.embedded]
host = "0.0.0.0"
port = 0
control_host = "::1"
control_port = 0
max_payload = "8MiB"
jetstream_max_store = "10GB"
credential_ttl = "12h"

[registry]
require_connection_bound = false

[admin]
socket = "/run/mesh/admin.sock"
group = "meshops"
mode = "0660"

[protections]
max_inbound_chars = 0
clock_skew_ahead = "90s"
live_max_age = "2m"
mailbox_max_age = "3d"
dedup_entries = 1

[inbox]
drain_interval = "500ms"
buffer_max_age = "5d"
buffer_max_bytes = 1048576

[keystore]
backend = "file"

[logging]
level = "DEBUG"
format = "journald"

[agents.echo]

[agents.chat-bot]
plugin = "chat"
enabled = false
interaction = "interactive"
model = "small"
limits = { per_minute = 5 }
"""


def test_every_documented_key(short_tmp_path: Path) -> None:
    c = load_text(short_tmp_path, FULL)
    assert c.node.name == "laptop"
    assert c.node.data_dir == Path("/srv/mesh")
    assert c.node.availability_class == "always_on"
    assert c.node.vouch_ttl == timedelta(hours=72)
    assert c.node.heartbeat_interval == timedelta(seconds=15)
    assert c.node.strict_plugins is True
    assert c.mesh.servers == ["nats://a.example:4222", "tls://b.example:4443"]
    assert not c.mesh.is_embedded
    assert c.mesh.credentials == Path("/etc/meshnode/node.creds")
    assert c.mesh.control_plane == "https://cp.example/api"
    e = c.mesh.embedded
    assert (e.host, e.port, e.control_host, e.control_port) == ("0.0.0.0", 0, "::1", 0)
    assert e.max_payload == 8 * 1024**2
    assert e.jetstream_max_store == 10 * 1000**3
    assert e.credential_ttl == timedelta(hours=12)
    assert c.registry.require_connection_bound is False
    assert c.admin.socket == Path("/run/mesh/admin.sock")
    assert c.admin.group == "meshops"
    assert c.admin.mode == 0o660
    assert c.admin.effective_mode == 0o660
    p = c.protections
    assert p.max_inbound_chars == 0
    assert p.clock_skew_ahead == timedelta(seconds=90)
    assert p.live_max_age == timedelta(minutes=2)
    assert p.mailbox_max_age == timedelta(days=3)
    assert p.dedup_entries == 1
    assert c.inbox.drain_interval == timedelta(milliseconds=500)
    assert c.inbox.buffer_max_age == timedelta(days=5)
    assert c.inbox.buffer_max_bytes == 1048576
    assert c.keystore.backend == "file"
    assert c.logging.level == "debug"
    assert c.logging.format == "journald"
    assert c.agents["echo"] == AgentConfig(plugin="echo", enabled=True, interaction=None)
    assert c.agents["echo"].settings == {}
    bot = c.agents["chat-bot"]
    assert (bot.plugin, bot.enabled, bot.interaction) == ("chat", False, "interactive")
    assert bot.settings == {"model": "small", "limits": {"per_minute": 5}}


def test_to_toml_dict_round_trips(short_tmp_path: Path) -> None:
    c = load_text(short_tmp_path, FULL)
    data = c.to_toml_dict()
    assert data["node"]["vouch_ttl"] == "3d"
    assert data["inbox"]["buffer_max_bytes"] == "1MiB"
    assert data["inbox"]["drain_interval"] == "500ms"
    assert data["admin"]["mode"] == "0660"
    assert data["agents"]["chat-bot"] == {
        "plugin": "chat",
        "enabled": False,
        "interaction": "interactive",
        "model": "small",
        "limits": {"per_minute": 5},
    }
    assert Config.model_validate(data).to_toml_dict() == data


def test_schema_export_names_every_table() -> None:
    schema = Config.model_json_schema()
    assert set(schema["properties"]) == {
        "node",
        "mesh",
        "registry",
        "services",
        "admin",
        "protections",
        "inbox",
        "storage",
        "commerce",
        "artifacts",
        "keystore",
        "logging",
        "events",
        "observability",
        "a2a",
        "agents",
    }
    node = schema["$defs"]["NodeConfig"]
    assert node["additionalProperties"] is False
    assert "string" in str(node["properties"]["heartbeat_interval"])


def test_editor_schema_uses_config_spelling() -> None:
    defs = Config.json_schema()["$defs"]
    assert defs["NodeConfig"]["properties"]["heartbeat_interval"]["default"] == "30s"
    assert defs["InboxConfig"]["properties"]["buffer_max_age"]["default"] == "7d"
    assert defs["AdminConfig"]["properties"]["socket"]["default"] == ""
    assert "default" not in defs["AdminConfig"]["properties"]["group"]
    assert defs["KeystoreConfig"]["properties"]["backend"]["enum"] == [
        "auto",
        "keyring",
        "systemd-credentials",
        "file",
    ]


# ---------------------------------------------------------------- errors


def test_unknown_key_names_file_and_key(short_tmp_path: Path) -> None:
    lines = problems_of(short_tmp_path, "[node]\nnmae = 'x'\n")
    assert len(lines) == 1
    file = str(short_tmp_path / "meshnode.toml")
    assert lines[0].startswith(f"{file}: node.nmae: unknown key (did you mean 'name'? expected one of: name, ")
    # A close spelling is named; a key like none of them only lists what is valid.
    [far] = problems_of(short_tmp_path, "[node]\nquux = 'x'\n")
    assert "did you mean" not in far and "expected one of: name, data_dir" in far


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[mesh.embedded]\nhots = 'x'\n", "mesh.embedded.hots"),
        ("[nodes]\nname = 'x'\n", "nodes"),
        ("top = 1\n", "top"),
        ("[admin]\nperms = '0600'\n", "admin.perms"),
    ],
)
def test_unknown_keys_everywhere_are_rejected(short_tmp_path: Path, text: str, key: str) -> None:
    lines = problems_of(short_tmp_path, text)
    assert [line.split(": ")[1] for line in lines] == [key]
    assert "unknown key" in lines[0]


def test_plugin_keys_are_not_rejected(short_tmp_path: Path) -> None:
    config = load_text(short_tmp_path, "[agents.echo]\nanything = 1\nnested = { a = 2 }\n")
    assert config.agents["echo"].settings == {"anything": 1, "nested": {"a": 2}}


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("[protections]\nlive_max_age = 'ten minutes'\n", "protections.live_max_age", "duration"),
        ("[protections]\nlive_max_age = '0s'\n", "protections.live_max_age", "greater than zero"),
        ("[protections]\nclock_skew_ahead = -5\n", "protections.clock_skew_ahead", "greater than"),
        ("[inbox]\ndrain_interval = true\n", "inbox.drain_interval", "duration"),
        ("[node]\nvouch_ttl = '3 days'\n", "node.vouch_ttl", "duration"),
        ("[inbox]\nbuffer_max_bytes = '25XB'\n", "inbox.buffer_max_bytes", "size"),
        ("[inbox]\nbuffer_max_bytes = 0\n", "inbox.buffer_max_bytes", "greater than zero"),
        ("[mesh.embedded]\nmax_payload = '128MiB'\n", "mesh.embedded.max_payload", "64MiB"),
        ("[node]\navailability_class = 'sometimes'\n", "node.availability_class", "always_on"),
        ("[keystore]\nbackend = 'vault'\n", "keystore.backend", "systemd-credentials"),
        ("[logging]\nformat = 'xml'\n", "logging.format", "journald"),
        ("[logging]\nlevel = 'loud'\n", "logging.level", "debug"),
        ("[agents.echo]\ninteraction = 'chatty'\n", "agents.echo.interaction", "interactive"),
        (
            "[protections]\ndedup_entries = 0\n",
            "protections.dedup_entries",
            "greater than or equal to 1",
        ),
        (
            "[protections]\nmax_inbound_chars = -1\n",
            "protections.max_inbound_chars",
            "greater than or equal to 0",
        ),
        ("[mesh.embedded]\nport = 70000\n", "mesh.embedded.port", "65535"),
        ("[mesh.embedded]\nport = 'high'\n", "mesh.embedded.port", "integer"),
        ("[mesh]\nservers = ['http://x']\n", "mesh.servers[0]", "nats://"),
        ("[mesh]\ncontrol_plane = 'cp.example'\n", "mesh.control_plane", "https://"),
        (
            "[registry]\nrequire_connection_bound = 'maybe'\n",
            "registry.require_connection_bound",
            "bool",
        ),
        ("[admin]\nmode = '0666'\n", "admin.mode", "never be accessible to others"),
        ("[admin]\nmode = '0604'\n", "admin.mode", "others"),
        ("[admin]\nmode = 'rw'\n", "admin.mode", "octal"),
        ("[admin]\nmode = '0400'\n", "admin.mode", "owner"),
        ("[node]\nname = ''\n", "node.name", "at least 1"),
        ("node = 5\n", "node", "table"),
        ("[agents.echo]\nplugin = 'a b'\n", "agents.echo.plugin", "entry point name"),
        ("[agents.echo]\nenabled = 'x'\n", "agents.echo.enabled", "boolean"),
        ("[agents]\necho = 5\n", "agents.echo", "table"),
    ],
)
def test_bad_values_are_named_precisely(short_tmp_path: Path, text: str, key: str, expected: str) -> None:
    lines = problems_of(short_tmp_path, text)
    assert len(lines) == 1, lines
    file, got_key, message = lines[0].split(": ", 2)
    assert file == str(short_tmp_path / "meshnode.toml")
    assert got_key == key
    assert expected in message


def test_each_problem_is_one_line_with_structured_fields(short_tmp_path: Path) -> None:
    text = "[node]\nbogus = 1\n[protections]\nlive_max_age = 'x'\n[inbox]\nbuffer_max_bytes = 'y'\n"
    with pytest.raises(ConfigError) as info:
        load_text(short_tmp_path, text)
    err = info.value
    assert err.path == short_tmp_path / "meshnode.toml"
    assert [p.key for p in err.problems] == [
        "node.bogus",
        "protections.live_max_age",
        "inbox.buffer_max_bytes",
    ]
    assert str(err).count("\n") == 2


def test_toml_syntax_error_names_line_and_column(short_tmp_path: Path) -> None:
    lines = problems_of(short_tmp_path, "[node]\nname = \n")
    assert len(lines) == 1
    assert lines[0].startswith(str(short_tmp_path / "meshnode.toml") + ": TOML syntax error")
    assert "line 2" in lines[0]
    assert "column" in lines[0]


def test_non_utf8_file_is_a_config_error(short_tmp_path: Path) -> None:
    path = short_tmp_path / "meshnode.toml"
    path.write_bytes(b"[node]\nname = '\xff'\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(str(path), env=user_env(short_tmp_path), euid=USER)


def test_directory_as_config_is_a_config_error(short_tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(str(short_tmp_path), env=user_env(short_tmp_path), euid=USER)


def test_bad_agent_names(short_tmp_path: Path) -> None:
    lines = problems_of(short_tmp_path, '[agents.Echo]\n[agents."has space"]\n[agents.ok]\n')
    assert [line.split(": ")[1] for line in lines] == ["agents.Echo", 'agents."has space"']
    assert all("[a-z0-9][a-z0-9_-]{0,63}" in line for line in lines)


def test_agent_name_length_limit(short_tmp_path: Path) -> None:
    assert load_text(short_tmp_path, f"[agents.{'a' * 64}]\n").agents
    assert problems_of(short_tmp_path, f"[agents.{'a' * 65}]\n")


# ---------------------------------------------------------------- cross-field checks


def test_mailbox_window_must_not_exceed_buffer_age(short_tmp_path: Path) -> None:
    lines = problems_of(short_tmp_path, "[protections]\nmailbox_max_age = '8d'\n")
    assert len(lines) == 1
    assert ": protections.mailbox_max_age: must not exceed inbox.buffer_max_age (7d)" in lines[0]
    config = load_text(
        short_tmp_path, "[protections]\nmailbox_max_age = '8d'\n[inbox]\nbuffer_max_age = '8d'\n"
    )
    assert config.protections.mailbox_max_age == timedelta(days=8)


def test_embedded_ports_must_differ(short_tmp_path: Path) -> None:
    lines = problems_of(short_tmp_path, "[mesh.embedded]\nport = 5000\ncontrol_port = 5000\n")
    assert ": mesh.embedded.control_port: must differ" in lines[0]
    assert load_text(short_tmp_path, "[mesh.embedded]\nport = 0\ncontrol_port = 0\n")


def test_group_without_group_access_is_contradictory(short_tmp_path: Path) -> None:
    lines = problems_of(short_tmp_path, "[admin]\ngroup = 'ops'\nmode = '0600'\n")
    assert ": admin.mode: 0600 gives admin.group 'ops' no access" in lines[0]


def test_admin_mode_accepts_toml_octal_and_group_defaults(short_tmp_path: Path) -> None:
    assert load_text(short_tmp_path, "[admin]\nmode = 0o660\n").admin.mode == 0o660
    grouped = load_text(short_tmp_path, "[admin]\ngroup = 'ops'\n").admin
    assert grouped.mode is None
    assert grouped.effective_mode == 0o660


# ---------------------------------------------------------------- UDS path length


def test_explicit_socket_path_too_long(short_tmp_path: Path) -> None:
    long_path = "/run/" + "x" * (UDS_PATH_MAX - len("/run/") - len(".sock") + 1) + ".sock"
    assert len(long_path) == UDS_PATH_MAX + 1
    lines = problems_of(short_tmp_path, f"[admin]\nsocket = '{long_path}'\n")
    assert len(lines) == 1
    assert f": admin.socket: the path '{long_path}' is {UDS_PATH_MAX + 1} bytes" in lines[0]
    assert "shorter path" in lines[0]


def test_socket_path_at_the_limit_is_accepted(short_tmp_path: Path) -> None:
    exact = "/run/" + "x" * (UDS_PATH_MAX - len("/run/") - len(".sock")) + ".sock"
    assert len(exact) == UDS_PATH_MAX
    assert str(load_text(short_tmp_path, f"[admin]\nsocket = '{exact}'\n").admin.socket) == exact


def test_derived_socket_path_too_long_says_so(short_tmp_path: Path) -> None:
    deep = "/srv/" + "d" * 120
    lines = problems_of(short_tmp_path, f"[node]\ndata_dir = '{deep}'\n")
    assert len(lines) == 1
    assert ": admin.socket: the default path " in lines[0]
    assert "set [admin] socket" in lines[0]
    # An explicit short socket makes the same data_dir fine.
    config = load_text(short_tmp_path, f"[node]\ndata_dir = '{deep}'\n[admin]\nsocket = '/run/m.sock'\n")
    assert config.admin.socket == Path("/run/m.sock")


# ---------------------------------------------------------------- file selection and env


def test_explicit_missing_file_is_an_error(short_tmp_path: Path) -> None:
    missing = short_tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(str(missing), env=user_env(short_tmp_path), euid=USER)
    assert str(info.value) == f"{missing}: config file not found (named by --config)"


def test_missing_file_named_by_env_is_an_error(short_tmp_path: Path) -> None:
    missing = short_tmp_path / "nope.toml"
    env = user_env(short_tmp_path, MESHNODE_CONFIG=str(missing))
    with pytest.raises(ConfigError, match=r"named by \$MESHNODE_CONFIG"):
        load_config(env=env, euid=USER)


def test_config_argument_beats_env(short_tmp_path: Path) -> None:
    a = write(short_tmp_path, "[node]\nname = 'from-arg'\n", "a.toml")
    b = write(short_tmp_path, "[node]\nname = 'from-env'\n", "b.toml")
    env = user_env(short_tmp_path, MESHNODE_CONFIG=str(b))
    assert load_config(str(a), env=env, euid=USER).node.name == "from-arg"
    assert load_config(env=env, euid=USER).node.name == "from-env"


def test_default_location_file_is_read(short_tmp_path: Path) -> None:
    env = user_env(short_tmp_path)
    target = short_tmp_path / "home/.config/meshnode/meshnode.toml"
    target.parent.mkdir(parents=True)
    target.write_text("[node]\nname = 'dflt'\n")
    config = load_config(env=env, euid=USER)
    assert config.node.name == "dflt"
    assert config.source_file == target


def test_data_dir_env_overrides_file(short_tmp_path: Path) -> None:
    config = load_text(
        short_tmp_path, "[node]\ndata_dir = '/srv/from-file'\n", MESHNODE_DATA_DIR="/srv/from-env"
    )
    assert config.node.data_dir == Path("/srv/from-env")
    assert config.admin.socket == Path("/srv/from-env/admin.sock")


def test_data_dir_env_overrides_defaults_and_relative_means_cwd(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(short_tmp_path)
    config = load_config(env=user_env(short_tmp_path, MESHNODE_DATA_DIR="rel/data"), euid=USER)
    assert config.node.data_dir == short_tmp_path / "rel/data"


def test_bad_data_dir_from_env_says_so(short_tmp_path: Path) -> None:
    lines = problems_of(short_tmp_path, "", MESHNODE_DATA_DIR="/" + "d" * 200)
    assert any("admin.socket" in line for line in lines)
    lines = problems_of(short_tmp_path, "[node]\ndata_dir = 5\n")
    assert ": node.data_dir: expected a directory path" in lines[0]


def test_relative_paths_resolve_against_the_config_file(short_tmp_path: Path) -> None:
    sub = short_tmp_path / "etc"
    sub.mkdir()
    path = write(sub, "[node]\ndata_dir = 'state'\n[mesh]\ncredentials = '../creds/node.creds'\n")
    config = load_config(str(path), env=user_env(short_tmp_path), euid=USER)
    assert config.node.data_dir == sub / "state"
    assert config.mesh.credentials == short_tmp_path / "creds/node.creds"


def test_tilde_expands_with_the_given_home(short_tmp_path: Path) -> None:
    config = load_text(short_tmp_path, "[node]\ndata_dir = '~/mesh'\n")
    assert config.node.data_dir == short_tmp_path / "home/mesh"


def test_stock_env_variables_do_not_leak_in(short_tmp_path: Path) -> None:
    # pydantic-settings' default env source would read NODE/LOGGING as whole tables.
    config = load_config(env=user_env(short_tmp_path, NODE='{"name": "x"}', LOGGING="x"), euid=USER)
    assert config.node.name == socket.gethostname()
    assert config.logging.level == "info"


def test_empty_strings_mean_unset(short_tmp_path: Path) -> None:
    text = (
        "[node]\navailability_class = ''\nvouch_ttl = ''\n"
        "[mesh]\ncredentials = ''\ncontrol_plane = ''\n"
        "[admin]\nsocket = ''\ngroup = ''\nmode = ''\n"
        "[agents.echo]\ninteraction = ''\n"
    )
    c = load_text(short_tmp_path, text)
    assert c.node.availability_class is None
    assert c.node.vouch_ttl is None
    assert c.mesh.credentials is None
    assert c.mesh.control_plane is None
    assert c.admin.socket == short_tmp_path / "home/.local/share/meshnode/admin.sock"
    assert (c.admin.group, c.admin.mode) == (None, None)
    assert c.agents["echo"].interaction is None


def test_describe_sources(short_tmp_path: Path) -> None:
    env = user_env(short_tmp_path, MESHNODE_DATA_DIR="/srv/env", XDG_RUNTIME_DIR="/run/user/1000")
    lines = describe_sources(env=env, euid=USER)
    home = short_tmp_path / "home"
    assert lines == [
        f"config file: {home}/.config/meshnode/meshnode.toml "
        "(default location; not present, built-in defaults)",
        "node.data_dir: /srv/env (from $MESHNODE_DATA_DIR)",
        "admin.socket: /run/user/1000/meshnode/admin.sock (default: $XDG_RUNTIME_DIR)",
    ]
    path = write(short_tmp_path, "[admin]\nsocket = '/run/x.sock'\n")
    lines = describe_sources(str(path), env=user_env(short_tmp_path), euid=USER)
    assert lines[0] == f"config file: {path} (from --config)"
    assert lines[1].endswith("(default: XDG data home)")
    assert lines[2] == "admin.socket: /run/x.sock (from the config file)"
    assert "MISSING" in describe_sources(str(short_tmp_path / "no.toml"), env={}, euid=USER)[0]


def test_describe_sources_survives_a_broken_file(short_tmp_path: Path) -> None:
    path = write(short_tmp_path, "[node\n")
    lines = describe_sources(str(path), env=user_env(short_tmp_path), euid=USER)
    assert lines[0] == f"config file: {path} (from --config)"
    assert len(lines) == 3


def test_config_built_directly_uses_the_process_environment(
    monkeypatch: pytest.MonkeyPatch, short_tmp_path: Path
) -> None:
    monkeypatch.setenv("MESHNODE_DATA_DIR", str(short_tmp_path / "direct"))
    assert Config().node.data_dir == short_tmp_path / "direct"


# ---------------------------------------------------------------- durations and sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", timedelta(milliseconds=500)),
        ("30s", timedelta(seconds=30)),
        ("10m", timedelta(minutes=10)),
        ("72h", timedelta(hours=72)),
        ("7d", timedelta(days=7)),
        ("1h30m", timedelta(minutes=90)),
        ("1.5s", timedelta(milliseconds=1500)),
        (" 5m ", timedelta(minutes=5)),
        (45, timedelta(seconds=45)),
        (0.25, timedelta(milliseconds=250)),
    ],
)
def test_parse_duration(text: Any, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "30", "5 m", "1x", "m5", "-5s", "0s", 0, -1, True, None, "1h-5m"]
)
def test_parse_duration_rejects(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("25MiB", 25 * 1024**2),
        ("1GiB", 1024**3),
        ("1MB", 1000**2),
        ("1mb", 1000**2),
        ("512KiB", 512 * 1024),
        ("100B", 100),
        ("1.5KiB", 1536),
        ("4096", 4096),
        (1048576, 1048576),
        (2048.0, 2048),
    ],
)
def test_parse_size(text: Any, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "5 XB", "1.5", 0, -5, 1.5, False, [1]])
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_round_trips() -> None:
    for text in ("500ms", "30s", "10m", "3d", "1h30m", "2d3h4m5s6ms"):
        assert format_duration(parse_duration(text)) == text
    assert format_size(25 * 1024**2) == "25MiB"
    assert format_size(1000) == "1000B"
    assert format_size(3 * 1024**3) == "3GiB"


def test_process_environment_is_untouched(short_tmp_path: Path) -> None:
    before = dict(os.environ)
    load_config(env=user_env(short_tmp_path, MESHNODE_DATA_DIR="/srv/x"), euid=USER)
    assert dict(os.environ) == before


# ---------------------------------------------------------------- [a2a]


def test_a2a_is_off_by_default(short_tmp_path: Path) -> None:
    cfg = load_text(short_tmp_path, "")
    assert cfg.a2a.listen is None and cfg.a2a.expose == [] and cfg.a2a.issuers == {}


def test_a2a_section_loads(short_tmp_path: Path) -> None:
    from meshnode.protocol.nkeys import KeyPair

    key = KeyPair.generate().public_key
    cfg = load_text(
        short_tmp_path,
        f'[agents.echo]\n[a2a]\nlisten = "127.0.0.1:8700"\nexpose = ["echo"]\n'
        f'idempotency_retention = "2h"\nallow_issuers = ["billing"]\n'
        f'[a2a.issuers.billing]\nkey = "{key}"\n',
    )
    assert cfg.a2a.listen == "127.0.0.1:8700" and cfg.a2a.expose == ["echo"]
    assert cfg.a2a.idempotency_retention == timedelta(hours=2)
    assert cfg.a2a.issuers["billing"].key == key


def test_a2a_listen_takes_an_inherited_socket(short_tmp_path: Path) -> None:
    cfg = load_text(short_tmp_path, '[agents.echo]\n[a2a]\nlisten = "fd://3"\nexpose = ["echo"]\n')
    assert cfg.a2a.listen == "fd://3"
    found = "\n".join(problems_of(short_tmp_path, '[agents.echo]\n[a2a]\nlisten = "fd://three"\n'))
    assert "a2a.listen" in found and '"fd://N"' in found


def test_a2a_errors_name_the_key(short_tmp_path: Path) -> None:
    text = (
        '[agents.echo]\n[a2a]\nlisten = "localhost"\nexpose = ["echo", "ghost"]\nmax_mesh_hops = 0\n'
        '[a2a.issuers.billing]\nkey = "not-a-key"\n'
    )
    found = "\n".join(problems_of(short_tmp_path, text))
    assert "a2a.listen" in found and "host:port" in found
    assert "a2a.max_mesh_hops" in found
    assert "a2a.issuers.billing.key" in found
    expose = problems_of(short_tmp_path, '[agents.echo]\n[a2a]\nlisten = "127.0.0.1:1"\nexpose = ["ghost"]\n')
    assert any("a2a.expose[0]" in p and "ghost" in p for p in expose)
    no_listen = problems_of(short_tmp_path, '[agents.echo]\n[a2a]\nexpose = ["echo"]\n')
    assert any("a2a.listen" in p for p in no_listen)
    reserved = problems_of(short_tmp_path, '[agents.a2a-bridge]\nplugin = "echo"\n[a2a]\nlisten = "127.0.0.1:1"\n')
    assert any("agents.a2a-bridge" in p and "reserved" in p for p in reserved)
