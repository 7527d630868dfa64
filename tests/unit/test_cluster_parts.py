"""Cluster deployment pieces without a server: config keys, cluster size, server config, service keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.services.identity import SERVICE_NAMES, ServiceKeyError, load_service_keys
from meshnode.transport.cluster import cluster_size_of
from meshnode.transport.embedded import ClusterRoutes, render_server_config

from .test_config import load_text, problems_of


def test_servers_takes_one_url_a_comma_list_or_a_list(short_tmp_path: Path) -> None:
    one = load_text(short_tmp_path, '[mesh]\nservers = "nats://a:4222"\n')
    assert one.mesh.servers == ["nats://a:4222"]
    several = load_text(short_tmp_path, '[mesh]\nservers = "nats://a:4222, nats://b:4223"\n')
    assert several.mesh.servers == ["nats://a:4222", "nats://b:4223"]
    listed = load_text(short_tmp_path, '[mesh]\nservers = ["nats://a:4222", "nats://b:4223", "nats://c:4224"]\n')
    assert len(listed.mesh.servers) == 3 and not listed.mesh.is_embedded


def test_replicas_and_services_keys(short_tmp_path: Path) -> None:
    config = load_text(short_tmp_path, '[mesh]\nservers = "nats://a:4222"\nreplicas = 3\n[services]\nrun = true\nkey_dir = "keys"\n')
    assert config.mesh.replicas == 3
    assert config.services.run is True
    assert config.services.key_dir == short_tmp_path / "keys"  # relative to the config file
    defaults = load_text(short_tmp_path, "")
    assert defaults.mesh.replicas is None and defaults.services.run is None and defaults.services.key_dir is None
    assert any("mesh.replicas" in p for p in problems_of(short_tmp_path, "[mesh]\nreplicas = 0\n"))
    assert any("services.running" in p for p in problems_of(short_tmp_path, "[services]\nrunning = true\n"))


def test_cluster_size_counts_distinct_servers() -> None:
    assert cluster_size_of([], []) == 1
    assert cluster_size_of(["nats://127.0.0.1:4222"], ["127.0.0.1:4222"]) == 1
    assert cluster_size_of(["nats://h1:4222"], ["h1:4222", "h2:4222", "h3:4222"]) == 3
    assert cluster_size_of(["nats://u:p@h1", "nats://h2:4222/"], []) == 2


def test_cluster_member_config_routes_to_the_others(short_tmp_path: Path) -> None:
    text = render_server_config(
        server_name="mesh-n1", host="127.0.0.1", port=4222, monitor_port=None,
        max_payload=1024, max_control_line=1024, operator_jwt="op", system_account="SYS",
        account_jwts={"ACC": "jwt"}, store_dir=short_tmp_path / "js", ports_file_dir=short_tmp_path,
        cluster=ClusterRoutes("mesh", "127.0.0.1", 6222, ("nats-route://127.0.0.1:6223",)),
    )
    assert 'server_name: "mesh-n1"' in text
    assert 'listen: "127.0.0.1:6222"' in text
    assert '"nats-route://127.0.0.1:6223"' in text
    plain = render_server_config(
        server_name="x", host="127.0.0.1", port=None, monitor_port=None, max_payload=1024,
        max_control_line=1024, operator_jwt="op", system_account="SYS", account_jwts={},
        store_dir=short_tmp_path, ports_file_dir=short_tmp_path,
    )
    assert "cluster {" not in plain and "routes" not in plain


def test_service_keys_are_shared_from_a_directory(short_tmp_path: Path) -> None:
    with pytest.raises(ServiceKeyError, match="registry.nk is missing"):
        load_service_keys(short_tmp_path / "keys")
    made = load_service_keys(short_tmp_path / "keys", create=True)
    assert sorted(made) == sorted(SERVICE_NAMES)
    again = load_service_keys(short_tmp_path / "keys")
    assert {n: k.public_key for n, k in again.items()} == {n: k.public_key for n, k in made.items()}
    assert oct((short_tmp_path / "keys" / "registry.nk").stat().st_mode & 0o777) == "0o600"


def test_the_shipped_cluster_configs_validate() -> None:
    from meshnode.config import load_config

    root = Path(__file__).resolve().parents[2] / "config" / "cluster"
    service = load_config(str(root / "service-node.toml"))
    participant = load_config(str(root / "participant-node.toml"))
    assert service.services.run is True and service.services.key_dir is not None
    assert len(service.mesh.servers) == 3 and participant.mesh.servers == service.mesh.servers
    assert participant.services.run is None  # joined: runs no services
