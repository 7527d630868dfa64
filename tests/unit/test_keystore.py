"""meshnode.keystore: file store permissions, systemd credentials, keyring selection."""

# keyring's backend constructors are unannotated; calling them is the point here.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import os
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import keyring
import keyring.backend
import pytest
from keyring.backends import chainer, fail, null
from keyring.compat import properties
from keyring.errors import KeyringLocked, PasswordDeleteError

from meshnode.keystore import (
    KEYRING_SERVICE,
    FileKeyStore,
    KeyringKeyStore,
    KeyStore,
    KeyStoreError,
    KeyStoreUnavailable,
    SystemdCredentialsKeyStore,
    detect_keyring,
    file_store,
    get_or_create_all,
    keyring_usable,
    open_keystore,
    validate_key_name,
)
from meshnode.protocol.nkeys import KeyPair, Prefix


class MemoryKeyring(keyring.backend.KeyringBackend):
    """An in-process keyring backend for tests (keyring ships none)."""

    @properties.classproperty
    def priority(cls) -> float:
        return 1

    def __init__(self) -> None:
        super().__init__()
        self.items: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.items.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.items[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        if self.items.pop((service, username), None) is None:
            raise PasswordDeleteError(username)


class LockedKeyring(MemoryKeyring):
    def get_password(self, service: str, username: str) -> str | None:
        raise KeyringLocked("Failed to unlock the collection!")


class ZeroPriorityKeyring(MemoryKeyring):
    @properties.classproperty
    def priority(cls) -> float:
        return 0


class BrokenPriorityKeyring(MemoryKeyring):
    @properties.classproperty
    def priority(cls) -> float:
        raise RuntimeError("backend not viable here")


# keyring registers every backend subclass for its own auto-detection; keep these
# test doubles out of it so nothing else in the process can select them.
for _cls in (MemoryKeyring, LockedKeyring, ZeroPriorityKeyring, BrokenPriorityKeyring):
    keyring.backend.KeyringBackend._classes.discard(_cls)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """Run with umask 000 so a test proves the store does not rely on the caller's umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def store(tmp_path: Path) -> FileKeyStore:
    return FileKeyStore(tmp_path / "data")


# ---------------------------------------------------------------- key names


@pytest.mark.parametrize("name", ["node", "agent.echo", "mesh.operator", "a", "x" * 128, "a-b_c.9"])
def test_valid_key_names(name: str) -> None:
    assert validate_key_name(name) == name


@pytest.mark.parametrize("name", ["", "Node", ".hidden", "a/b", "../x", "x" * 129, "a b", "-x"])
def test_invalid_key_names(name: str, store: FileKeyStore) -> None:
    with pytest.raises(ValueError, match="invalid key name"):
        validate_key_name(name)
    with pytest.raises(ValueError):
        store.get_or_create(name)


# ---------------------------------------------------------------- file store


def test_file_store_permissions(store: FileKeyStore, permissive_umask: None) -> None:
    pair = store.get_or_create("agent.echo")
    path = store.path_for("agent.echo")
    assert mode_of(store.directory) == 0o700
    assert mode_of(path) == 0o600
    assert path == store.data_dir / "keys" / "agent.echo.seed"
    assert path.read_text() == pair.seed + "\n"
    # Nothing but the key itself is left in the directory (no temp files).
    assert os.listdir(store.directory) == ["agent.echo.seed"]


def test_get_or_create_is_idempotent(store: FileKeyStore) -> None:
    first = store.get_or_create("node")
    second = store.get_or_create("node")
    again = FileKeyStore(store.data_dir).get("node")
    assert first.public_key == second.public_key
    assert again is not None
    assert again.public_key == first.public_key
    assert again.seed == first.seed
    assert first.role == Prefix.USER


def test_get_or_create_all_writes_new_keys_in_one_batch(store: FileKeyStore, permissive_umask: None) -> None:
    existing = store.get_or_create("agent.a003")
    names = [f"agent.a{i:03d}" for i in range(40)]
    keys = get_or_create_all(store, [*names, "agent.a001"])  # a repeated name gets the same key
    assert [k.public_key for k in keys[:40]] == [store.get(n).public_key for n in names]  # type: ignore[union-attr]
    assert keys[3].public_key == existing.public_key and keys[40].public_key == keys[1].public_key
    assert len({k.public_key for k in keys[:40]}) == 40
    assert all(mode_of(store.path_for(n)) == 0o600 for n in names)
    assert sorted(os.listdir(store.directory)) == sorted(f"{n}.seed" for n in names)  # no temp files left
    # Idempotent: a second batch reads what the first wrote.
    again = get_or_create_all(FileKeyStore(store.data_dir), names)
    assert [k.seed for k in again] == [k.seed for k in keys[:40]]



@pytest.mark.parametrize("flush", ["syncfs", "fsync each file"])
def test_a_batch_is_durable_before_any_key_is_linked_into_place(
    store: FileKeyStore, monkeypatch: pytest.MonkeyPatch, flush: str
) -> None:
    """A failed flush (the disk full, say) leaves neither a key file nor a temporary
    one: no key is in place that a crash could leave empty. Both ways of making the
    batch durable: one syncfs(2) (Linux) and an fsync per file (elsewhere)."""
    if flush == "syncfs" and file_store._SYNCFS is None:
        pytest.skip("no syncfs(2) on this platform")
    if flush == "fsync each file":
        monkeypatch.setattr(file_store, "_SYNCFS", None)

    calls = []

    def full(*_: object) -> None:
        calls.append(1)
        if flush == "syncfs" or len(calls) >= 3:  # fsync: two files flushed, then the disk is full
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_store, "_syncfs", full)
    monkeypatch.setattr(os, "fsync", full)
    names = [f"agent.b{i:02d}" for i in range(12)]
    with pytest.raises(KeyStoreError, match="No space left"):
        get_or_create_all(store, names)  # syncfs: its first call fails; fsync: the third file's
    assert os.listdir(store.directory) == []
    monkeypatch.undo()
    if flush == "fsync each file":
        monkeypatch.setattr(file_store, "_SYNCFS", None)
    keys = get_or_create_all(store, names)
    assert sorted(os.listdir(store.directory)) == sorted(f"{n}.seed" for n in names)
    assert [store.get(n).public_key for n in names] == [k.public_key for k in keys]  # type: ignore[union-attr]

def test_get_missing_and_names_and_delete(store: FileKeyStore) -> None:
    assert store.get("node") is None
    assert store.names() == []
    assert store.delete("node") is False
    store.get_or_create("node")
    store.get_or_create("agent.b")
    store.get_or_create("agent.a")
    (store.directory / ".agent.a.0123.tmp").write_text("leftover")
    (store.directory / "README").write_text("not a key")
    assert store.names() == ["agent.a", "agent.b", "node"]
    assert store.delete("agent.a") is True
    assert not (store.directory / ".agent.a.0123.tmp").exists()
    assert store.get("agent.a") is None
    assert store.names() == ["agent.b", "node"]


def test_roles(store: FileKeyStore) -> None:
    op = store.get_or_create("mesh.operator", Prefix.OPERATOR)
    assert op.role == Prefix.OPERATOR
    assert op.public_key.startswith("O")
    # Without a role the stored key is returned as it is.
    assert store.get_or_create("mesh.operator").public_key == op.public_key
    with pytest.raises(KeyStoreError, match="is a operator key, expected a user key"):
        store.get_or_create("mesh.operator", Prefix.USER)


def test_refuses_group_or_world_readable_key(store: FileKeyStore) -> None:
    store.get_or_create("agent.echo")
    path = store.path_for("agent.echo")
    os.chmod(path, 0o644)
    with pytest.raises(KeyStoreError) as info:
        store.get("agent.echo")
    message = str(info.value)
    assert str(path) in message
    assert "mode 0644" in message
    assert f"chmod 600 {path}" in message
    assert info.value.path == path
    with pytest.raises(KeyStoreError):
        store.get_or_create("agent.echo")  # never replaced silently either
    os.chmod(path, 0o640)
    with pytest.raises(KeyStoreError, match="group or others"):
        store.get("agent.echo")
    os.chmod(path, 0o600)
    assert store.get("agent.echo") is not None


def test_refuses_open_key_directory(store: FileKeyStore) -> None:
    store.get_or_create("node")
    os.chmod(store.directory, 0o755)
    with pytest.raises(KeyStoreError, match=r"chmod 700"):
        store.get("node")


def test_refuses_symlinked_key_file(store: FileKeyStore, tmp_path: Path) -> None:
    store.get_or_create("node")
    target = tmp_path / "elsewhere.seed"
    target.write_text(KeyPair.generate().seed)
    os.chmod(target, 0o600)
    os.symlink(target, store.path_for("agent.x"))
    with pytest.raises(KeyStoreError, match="symlink"):
        store.get("agent.x")


def test_corrupt_key_file_names_the_file_without_content(store: FileKeyStore) -> None:
    store.get_or_create("node")
    path = store.path_for("node")
    secret = KeyPair.generate().seed
    path.write_text(secret[:-3] + "AAA")
    with pytest.raises(KeyStoreError) as info:
        store.get("node")
    assert str(path) in str(info.value)
    assert secret[:20] not in str(info.value)


def test_create_never_replaces_a_key_that_appeared_meanwhile(tmp_path: Path) -> None:
    winner = FileKeyStore(tmp_path).get_or_create("node")

    class RacingStore(FileKeyStore):
        """Misses the existing key once, as if another process wrote it just now."""

        missed = False

        def _read(self, name: str) -> KeyPair | None:
            if not self.missed:
                self.missed = True
                return None
            return super()._read(name)

    got = RacingStore(tmp_path).get_or_create("node")
    assert got.public_key == winner.public_key
    assert FileKeyStore(tmp_path).names() == ["node"]
    assert os.listdir(tmp_path / "keys") == ["node.seed"]


def test_concurrent_creators_agree(tmp_path: Path) -> None:
    results: list[str] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        results.append(FileKeyStore(tmp_path).get_or_create("agent.race").public_key)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = FileKeyStore(tmp_path).get("agent.race")
    assert stored is not None
    assert set(results) == {stored.public_key}


def test_failed_write_leaves_nothing_behind(
    store: FileKeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(KeyStoreError, match="No space left"):
        store.get_or_create("node")
    assert os.listdir(store.directory) == []
    monkeypatch.undo()
    assert store.get("node") is None


def test_repr_and_describe_never_show_a_seed(store: FileKeyStore) -> None:
    pair = store.get_or_create("node")
    for text in (repr(store), store.describe(), repr(pair)):
        assert pair.seed not in text
    assert str(store.directory) in store.describe()


def test_file_store_satisfies_the_protocol(store: FileKeyStore) -> None:
    assert isinstance(store, KeyStore)
    assert store.kind == "file"


# ---------------------------------------------------------------- systemd credentials


@pytest.fixture
def creds(tmp_path: Path) -> tuple[Path, KeyPair]:
    directory = tmp_path / "credentials"
    directory.mkdir()
    node = KeyPair.generate()
    (directory / "node").write_text(node.seed + "\n")
    (directory / "unrelated.cfg").write_text("x")
    return directory, node


def test_credentials_read_and_fall_through(tmp_path: Path, creds: tuple[Path, KeyPair]) -> None:
    directory, node = creds
    store = open_keystore(
        "systemd-credentials", tmp_path / "data", env={"CREDENTIALS_DIRECTORY": str(directory)}
    )
    assert isinstance(store, SystemdCredentialsKeyStore)
    assert store.kind == "systemd-credentials"
    got = store.get("node")
    assert got is not None
    assert got.public_key == node.public_key
    assert store.get_or_create("node").public_key == node.public_key
    # A key created at runtime cannot go into the credentials directory: file store.
    assert store.get("agent.new") is None
    agent = store.get_or_create("agent.new")
    assert (tmp_path / "data/keys/agent.new.seed").exists()
    assert not (directory / "agent.new").exists()
    again = store.get("agent.new")
    assert again is not None
    assert again.public_key == agent.public_key
    # Other credentials of the unit (unrelated.cfg) are not keys.
    assert store.names() == ["agent.new", "node"]


def test_credentials_describe_says_both(tmp_path: Path, creds: tuple[Path, KeyPair]) -> None:
    directory, node = creds
    store = SystemdCredentialsKeyStore(directory, FileKeyStore(tmp_path / "data"))
    text = store.describe()
    assert f"systemd credentials {directory}" in text
    assert "read-only: node)" in text
    assert str(tmp_path / "data" / "keys") in text
    assert node.seed not in text + repr(store)


def test_credential_keys_cannot_be_deleted(tmp_path: Path, creds: tuple[Path, KeyPair]) -> None:
    directory, _ = creds
    store = SystemdCredentialsKeyStore(directory, FileKeyStore(tmp_path / "data"))
    with pytest.raises(KeyStoreError, match="LoadCredential"):
        store.delete("node")
    store.get_or_create("agent.x")
    assert store.delete("agent.x") is True
    assert store.delete("agent.x") is False


def test_bad_credential_is_named(tmp_path: Path, creds: tuple[Path, KeyPair]) -> None:
    directory, _ = creds
    (directory / "agent.bad").write_text("not a seed")
    store = SystemdCredentialsKeyStore(directory, FileKeyStore(tmp_path / "data"))
    with pytest.raises(KeyStoreError, match=str(directory / "agent.bad")):
        store.get("agent.bad")


def test_systemd_credentials_backend_needs_the_directory(tmp_path: Path) -> None:
    with pytest.raises(KeyStoreUnavailable, match="CREDENTIALS_DIRECTORY"):
        open_keystore("systemd-credentials", tmp_path, env={})


# ---------------------------------------------------------------- keyring usability


def test_keyring_usable_rejects_non_storing_backends() -> None:
    assert not keyring_usable(None)
    assert not keyring_usable(fail.Keyring())
    assert not keyring_usable(null.Keyring())
    assert not keyring_usable(ZeroPriorityKeyring())
    assert not keyring_usable(BrokenPriorityKeyring())
    assert keyring_usable(MemoryKeyring())


def test_keyring_usable_rejects_an_empty_chainer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyring.backend, "get_all_keyring", lambda: [fail.Keyring()])
    assert not keyring_usable(chainer.ChainerBackend())


def test_detect_keyring_skips_linux_without_a_session_bus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if sys.platform in ("darwin", "win32"):
        pytest.skip("the session-bus shortcut applies to Linux/BSD only")

    def must_not_probe() -> keyring.backend.KeyringBackend:
        raise AssertionError("probed keyring on a headless host")

    monkeypatch.setattr(keyring, "get_keyring", must_not_probe)
    assert detect_keyring({}) is None


def test_detect_keyring_returns_a_usable_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = MemoryKeyring()
    monkeypatch.setattr(keyring, "get_keyring", lambda: memory)
    assert detect_keyring({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}) is memory
    monkeypatch.setattr(keyring, "get_keyring", fail.Keyring)
    assert detect_keyring({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}) is None


def test_detect_keyring_gives_up_on_a_hanging_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hang() -> keyring.backend.KeyringBackend:
        release.wait(10)
        return MemoryKeyring()

    monkeypatch.setattr(keyring, "get_keyring", hang)
    try:
        assert detect_keyring({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}, timeout=0.05) is None
    finally:
        release.set()


def test_detect_keyring_swallows_probe_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> keyring.backend.KeyringBackend:
        raise RuntimeError("dbus said no")

    monkeypatch.setattr(keyring, "get_keyring", boom)
    assert detect_keyring({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}) is None


# ---------------------------------------------------------------- keyring store


def test_keyring_store_round_trip(tmp_path: Path) -> None:
    backend = MemoryKeyring()
    store = open_keystore("keyring", tmp_path / "data", env={}, keyring_probe=lambda: backend)
    assert isinstance(store, KeyringKeyStore)
    assert store.kind == "keyring"
    assert store.get("node") is None
    pair = store.get_or_create("node")
    assert store.get_or_create("node").public_key == pair.public_key
    scope = KeyringKeyStore.scope_for(tmp_path / "data")
    assert backend.items[(KEYRING_SERVICE, f"{scope}/node")] == pair.seed
    store.get_or_create("agent.echo")
    assert store.names() == ["agent.echo", "node"]
    assert store.delete("node") is True
    assert store.delete("node") is False
    assert store.names() == ["agent.echo"]
    assert (KEYRING_SERVICE, f"{scope}/node") not in backend.items
    assert pair.seed not in repr(store) + store.describe()
    assert "MemoryKeyring" in store.describe()


def test_keyring_scope_separates_nodes(tmp_path: Path) -> None:
    backend = MemoryKeyring()
    a = KeyringKeyStore(backend, KeyringKeyStore.scope_for(tmp_path / "a"))
    b = KeyringKeyStore(backend, KeyringKeyStore.scope_for(tmp_path / "b"))
    assert a.scope != b.scope
    assert a.get_or_create("node").public_key != b.get_or_create("node").public_key
    assert KeyringKeyStore.scope_for(tmp_path / "a") == a.scope


def test_keyring_errors_are_wrapped(tmp_path: Path) -> None:
    store = KeyringKeyStore(LockedKeyring(), "scope")
    with pytest.raises(KeyStoreError, match="KeyringLocked"):
        store.get("node")


def test_keyring_bad_entry_is_named(tmp_path: Path) -> None:
    backend = MemoryKeyring()
    backend.items[(KEYRING_SERVICE, "scope/node")] = "garbage"
    with pytest.raises(KeyStoreError, match="scope/node"):
        KeyringKeyStore(backend, "scope").get("node")


def test_explicit_keyring_without_a_usable_backend(tmp_path: Path) -> None:
    for probe in (lambda: None, fail.Keyring, null.Keyring):
        with pytest.raises(KeyStoreUnavailable, match="backend 'file'"):
            open_keystore("keyring", tmp_path, env={}, keyring_probe=probe)


# ---------------------------------------------------------------- auto selection


def test_auto_prefers_systemd_credentials(tmp_path: Path, creds: tuple[Path, KeyPair]) -> None:
    directory, _ = creds

    def no_probe() -> keyring.backend.KeyringBackend:
        raise AssertionError("keyring probed although credentials are present")

    store = open_keystore(
        "auto",
        tmp_path,
        env={"CREDENTIALS_DIRECTORY": str(directory)},
        keyring_probe=no_probe,
        system_service=False,
    )
    assert isinstance(store, SystemdCredentialsKeyStore)


def test_auto_uses_a_usable_keyring_outside_system_services(tmp_path: Path) -> None:
    backend = MemoryKeyring()
    store = open_keystore(
        "auto", tmp_path, env={}, keyring_probe=lambda: backend, system_service=False
    )
    assert isinstance(store, KeyringKeyStore)
    assert store.backend is backend


def test_auto_never_probes_the_keyring_for_a_system_service(tmp_path: Path) -> None:
    def no_probe() -> keyring.backend.KeyringBackend:
        raise AssertionError("keyring probed in a system service")

    store = open_keystore("auto", tmp_path, env={}, keyring_probe=no_probe, system_service=True)
    assert isinstance(store, FileKeyStore)


def test_auto_system_service_detected_from_env(tmp_path: Path) -> None:
    calls: list[int] = []

    def probe() -> keyring.backend.KeyringBackend:
        calls.append(1)
        return MemoryKeyring()

    # INVOCATION_ID without a session's XDG_RUNTIME_DIR: a systemd system unit.
    store = open_keystore("auto", tmp_path, env={"INVOCATION_ID": "x"}, keyring_probe=probe)
    assert isinstance(store, FileKeyStore)
    assert calls == []


@pytest.mark.parametrize("found", [None, fail.Keyring(), null.Keyring(), ZeroPriorityKeyring()])
def test_auto_falls_back_to_the_file_store(
    tmp_path: Path, found: keyring.backend.KeyringBackend | None
) -> None:
    store = open_keystore(
        "auto", tmp_path, env={}, keyring_probe=lambda: found, system_service=False
    )
    assert isinstance(store, FileKeyStore)
    assert store.directory == tmp_path / "keys"


def test_file_backend_by_name(tmp_path: Path) -> None:
    store = open_keystore("file", tmp_path, env={"CREDENTIALS_DIRECTORY": "/x"})
    assert isinstance(store, FileKeyStore)


def test_unknown_backend_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown keystore backend 'vault'"):
        open_keystore("vault", tmp_path, env={})
