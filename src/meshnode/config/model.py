"""The whole configuration, :class:`Config`: its tables, cross-table checks, the
environment overrides, and its JSON schema and TOML forms."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from .a2a import A2AConfig
from .sections import (
    AdminConfig,
    AgentConfig,
    ArtifactsConfig,
    CommerceConfig,
    EventsConfig,
    InboxConfig,
    KeystoreConfig,
    LoggingConfig,
    MeshConfig,
    NodeConfig,
    ObservabilityConfig,
    ProtectionsConfig,
    RegistryConfig,
    ServicesConfig,
    StorageConfig,
)
from .values import (
    _AGENT_NAME,
    DATA_DIR_ENV,
    UDS_PATH_MAX,
    _context,
    _Problems,
    _SizeMarker,
    _toml_key,
    default_admin_socket,
    format_duration,
    format_size,
)

__all__ = [
    "Config",
]


class _EnvSource(PydanticBaseSettingsSource):
    """The environment overrides, read from the mapping given to :func:`load_config`.

    The stock env source is not used: it would map variables such as ``NODE``
    or ``LOGGING`` onto whole tables and cannot read an injected mapping.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        ctx = _context()
        value = ctx.env.get(DATA_DIR_ENV, "")
        if not value:
            return {}
        if os.path.isabs(value) or value.startswith("~"):
            return {"node": {"data_dir": value}}
        # A relative value from the environment means the caller's cwd, not the file's dir.
        return {"node": {"data_dir": os.path.abspath(value)}}


class Config(BaseSettings):
    """The whole daemon configuration. Load it with :func:`load_config`."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=False)

    node: NodeConfig = Field(default_factory=NodeConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    protections: ProtectionsConfig = Field(default_factory=ProtectionsConfig)
    inbox: InboxConfig = Field(default_factory=InboxConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    commerce: CommerceConfig = Field(default_factory=CommerceConfig)
    artifacts: ArtifactsConfig = Field(default_factory=ArtifactsConfig)
    keystore: KeystoreConfig = Field(default_factory=KeystoreConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    a2a: A2AConfig = Field(default_factory=A2AConfig)
    agents: dict[str, AgentConfig] = Field(default_factory=dict)
    """Hosted agents by local name (``[a-z0-9][a-z0-9_-]{0,63}``)."""

    _source_file: Path | None = PrivateAttr(default=None)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        ctx = _context()
        return (
            init_settings,
            _EnvSource(settings_cls),
            TomlConfigSettingsSource(settings_cls, toml_file=ctx.toml_file),
        )

    @property
    def source_file(self) -> Path | None:
        """The file this config was read from (None: defaults only)."""
        return self._source_file

    @field_validator("agents", mode="before")
    @classmethod
    def _agent_tables(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        problems: list[tuple[str, str]] = []
        tables: dict[str, Any] = {}
        for name, table in value.items():
            if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
                problems.append(
                    (
                        f"agents.{_toml_key(str(name))}",
                        "agent name must match [a-z0-9][a-z0-9_-]{0,63} "
                        "(lower-case letters, digits, '_' and '-', up to 64 characters)",
                    )
                )
                continue
            if isinstance(table, dict) and "plugin" not in table:
                table = {"plugin": name, **table}
            tables[name] = table
        if problems:
            raise _Problems(problems)
        return tables

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        problems: list[tuple[str, str]] = []
        p, inbox = self.protections, self.inbox
        if p.mailbox_max_age > inbox.buffer_max_age:
            problems.append(
                (
                    "protections.mailbox_max_age",
                    f"must not exceed inbox.buffer_max_age ({format_duration(inbox.buffer_max_age)}), "
                    f"got {format_duration(p.mailbox_max_age)}",
                )
            )
        emb = self.mesh.embedded
        if emb.port and emb.port == emb.control_port:
            problems.append(
                ("mesh.embedded.control_port", f"must differ from mesh.embedded.port ({emb.port})")
            )
        admin = self.admin
        if admin.group and admin.mode is not None and not admin.mode & 0o060:
            problems.append(
                (
                    "admin.mode",
                    f"{admin.mode:04o} gives admin.group {admin.group!r} no access; "
                    'use "0660" or leave admin.group empty',
                )
            )
        derived = admin.socket == Path()
        if derived:
            ctx = _context()
            admin.socket = Path(os.path.normpath(default_admin_socket(self.node.data_dir, ctx.env)))
        length = len(os.fsencode(admin.socket))
        if length > UDS_PATH_MAX:
            origin = "the default path" if derived else "the path"
            problems.append(
                (
                    "admin.socket",
                    f"{origin} {str(admin.socket)!r} is {length} bytes; Unix socket paths must "
                    f"stay within {UDS_PATH_MAX} bytes: set [admin] socket to a shorter path",
                )
            )
        for i, name in enumerate(self.a2a.expose):
            agent = self.agents.get(name)
            if agent is None or not agent.enabled:
                problems.append(
                    (
                        f"a2a.expose[{i}]",
                        f"{name!r} is not an enabled [agents.<name>] table of this node",
                    )
                )
        if self.a2a.listen is not None and "a2a-bridge" in self.agents:
            problems.append(
                ("agents.a2a-bridge", "the name is reserved for the A2A bridge's identity when [a2a] listen is set")
            )
        if self.a2a.listen is None and self.a2a.expose:
            problems.append(("a2a.listen", "a2a.expose lists agents but no listen address is set"))
        if problems:
            raise _Problems(problems)
        return self

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """JSON Schema of the TOML file, for editors and ``meshnode config schema``.

        Unlike :meth:`model_json_schema`, defaults are shown in config spelling
        (``"30s"``, not ISO 8601) and unset optional keys carry no default.
        """
        schema: dict[str, Any] = _drop_null_defaults(
            cls.model_json_schema(schema_generator=_TomlSchema)
        )
        return schema

    def to_toml_dict(self) -> dict[str, Any]:
        """The configuration as TOML-ready data: durations and sizes in config spelling,
        paths as strings, unset optional keys omitted, agent settings flattened."""
        return _model_to_toml(self)


class _TomlSchema(GenerateJsonSchema):
    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, timedelta):
            return format_duration(dft)
        if isinstance(dft, Path):
            return "" if dft == Path() else str(dft)
        return super().encode_default(dft)


def _drop_null_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: _drop_null_defaults(v) for k, v in node.items() if not (k == "default" and v is None)
        }
    if isinstance(node, list):
        return [_drop_null_defaults(v) for v in node]
    return node


def _model_to_toml(model: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(model, AgentConfig) and name == "settings":
            out.update(value)
            continue
        if isinstance(model, AdminConfig) and name == "mode" and value is not None:
            out[name] = f"{value:04o}"
            continue
        converted = _value_to_toml(value, info)
        if converted is not None:
            out[info.alias or name] = converted
    return out


def _value_to_toml(value: Any, info: FieldInfo | None) -> Any:
    if value is None:
        return None
    if isinstance(value, BaseModel):
        return _model_to_toml(value)
    if isinstance(value, dict):
        return {k: _value_to_toml(v, None) for k, v in value.items()}
    if isinstance(value, list):
        return [_value_to_toml(v, None) for v in value]
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, Path):
        return str(value)
    if (
        info is not None
        and isinstance(value, int)
        and not isinstance(value, bool)
        and any(isinstance(m, _SizeMarker) for m in info.metadata)
    ):
        return format_size(value)
    return value


