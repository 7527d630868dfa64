"""Tenancy pieces without a broker: configuration, the export/import links the
account JWTs carry, and the profile a node reads from its own credential (§15, §9.7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.config import ConfigError, load_config
from meshnode.daemon.main import credential_profile
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.transport.embedded import (
    TenantExport,
    account_links,
    external_discover_subject,
    external_get_subject,
    imported_agents,
)

AGENT = KeyPair.generate(Prefix.USER).public_key


def _load(short_tmp_path: Path, text: str) -> object:
    path = short_tmp_path / "meshnode.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(str(path), env={"HOME": str(short_tmp_path)}, euid=1000)


def test_tenants_and_exports_load_and_write_back_under_their_toml_names(short_tmp_path: Path) -> None:
    config = _load(short_tmp_path, f"""
[mesh.embedded]
tenants = ["family"]
[[mesh.embedded.exports]]
from = "family"
to = "mesh"
agents = ["{AGENT}"]
discover = true
""")
    embedded = config.mesh.embedded  # type: ignore[attr-defined]
    assert embedded.tenants == ["family"]
    assert embedded.exports[0].from_ == "family" and embedded.exports[0].agents == [AGENT]
    written = config.to_toml_dict()["mesh"]["embedded"]["exports"][0]  # type: ignore[attr-defined]
    assert written["from"] == "family" and "from_" not in written


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('tenants = ["mesh"]', "not 'mesh'"),
        ('tenants = ["Family"]', "tenants"),
        ('[[mesh.embedded.exports]]\nfrom = "nobody"\nto = "mesh"\ndiscover = true', "'nobody'"),
        ('tenants = ["f"]\n[[mesh.embedded.exports]]\nfrom = "f"\nto = "f"\ndiscover = true', "itself"),
        ('tenants = ["f"]\n[[mesh.embedded.exports]]\nfrom = "f"\nto = "mesh"', "names agents"),
        ('tenants = ["f"]\n[[mesh.embedded.exports]]\nfrom = "f"\nto = "mesh"\nagents = ["echo"]',
         r"exports\[0\]\.agents: 'echo' is not an agent id: an export names agents by id"),
    ],
)
def test_bad_tenancy_configuration_names_the_problem(short_tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        _load(short_tmp_path, "[mesh.embedded]\n" + text + "\n")


def test_an_export_becomes_one_export_and_one_import() -> None:
    a, b, c = (KeyPair.generate(Prefix.ACCOUNT).public_key for _ in range(3))
    links = account_links(
        {"mesh": a, "b": b, "c": c},
        [TenantExport("mesh", "b", agents=(AGENT,), discover=True),
         TenantExport("mesh", "c", agents=(AGENT,))],
    )
    exports, imports = links["mesh"]
    # Offered once per subject, however many tenants take it.
    assert [e.subject for e in exports] == [
        f"mesh.agent.{AGENT}.inbox", f"mesh.registry.get.{AGENT}", "mesh.registry.discover",
    ]
    assert imports == []
    _, b_imports = links["b"]
    assert {(i.account, i.subject, i.local_subject) for i in b_imports} == {
        (a, f"mesh.agent.{AGENT}.inbox", f"mesh.agent.{AGENT}.inbox"),
        (a, f"mesh.registry.get.{AGENT}", f"mesh.external.mesh.get.{AGENT}"),
        (a, "mesh.registry.discover", external_discover_subject("mesh")),
    }
    assert [i.subject for i in links["c"][1]] == [
        f"mesh.agent.{AGENT}.inbox", f"mesh.registry.get.{AGENT}",
    ]
    assert imported_agents("b", [TenantExport("mesh", "b", agents=(AGENT,))]) == {
        AGENT: external_get_subject("mesh", AGENT),
    }
    with pytest.raises(ValueError, match="not configured"):
        account_links({"mesh": a}, [TenantExport("mesh", "b", discover=True)])
    with pytest.raises(ValueError, match="agent id"):
        TenantExport("mesh", "b", agents=("not-a-key",))


def test_a_node_reads_its_attested_profile_from_its_credential_tags() -> None:
    tags = ["agentmesh:role:participant", "agentmesh:trust_tier:sandbox", "agentmesh:tenant:family"]
    assert credential_profile({"nats": {"tags": tags}}) == {
        "role": "participant", "trust_tier": "sandbox", "tenant": "family",
    }
    # A credential without tags was issued as a standard participant of the mesh account.
    assert credential_profile({"nats": {}}) == {
        "role": "participant", "trust_tier": "standard", "tenant": "mesh",
    }
