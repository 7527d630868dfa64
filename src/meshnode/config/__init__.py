"""The daemon's TOML configuration.

One file, found in this order: the ``--config`` argument, ``$MESHNODE_CONFIG``,
then the default location (``$CONFIGURATION_DIRECTORY/meshnode.toml`` when
systemd provides one, ``/etc/meshnode/meshnode.toml`` for root or a systemd
system service, else ``$XDG_CONFIG_HOME/meshnode/meshnode.toml``). A missing
default file means "all defaults"; a missing file that was asked for by name is
an error. Every key is optional; unknown keys are rejected, except inside an
``[agents.<name>]`` table, whose extra keys belong to the agent's plugin and are
kept in :attr:`AgentConfig.settings` for the plugin's own model to validate.

Durations are written ``"500ms"``, ``"30s"``, ``"10m"``, ``"72h"``, ``"7d"``
(units may be combined: ``"1h30m"``) or as a number of seconds, and load as
:class:`datetime.timedelta`. Sizes are written ``"25MiB"``, ``"1GiB"``,
``"1MB"`` or as a number of bytes, and load as ``int`` bytes.

Every problem becomes one line of a :class:`ConfigError` naming the file, the
dotted key and what was expected, so ``meshnode check-config`` can print it and
exit :data:`EX_CONFIG` (systemd's ``RestartPreventExitStatus=78``).

The package's modules: :mod:`.values` (constants, errors, durations, sizes,
platform defaults), :mod:`.sections` and :mod:`.a2a` (the tables), :mod:`.model`
(:class:`Config`), :mod:`.loading` (:func:`load_config`). Import from here.
"""

from __future__ import annotations

from .a2a import (
    A2AConfig,
    A2APeerConfig,
)
from .loading import (
    describe_sources,
    load_config,
    resolve_config_path,
    settings_problems,
)
from .model import (
    Config,
)
from .sections import (
    AdminConfig,
    AgentConfig,
    ArtifactsConfig,
    EmbeddedMeshConfig,
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
    CONFIG_ENV,
    DATA_DIR_ENV,
    EX_CONFIG,
    UDS_PATH_MAX,
    ConfigError,
    ConfigProblem,
    default_admin_socket,
    default_config_path,
    default_data_dir,
    format_duration,
    format_size,
    is_system_service,
    parse_duration,
    parse_size,
)

__all__ = [
    "A2AConfig",
    "A2APeerConfig",
    "CONFIG_ENV",
    "DATA_DIR_ENV",
    "EX_CONFIG",
    "UDS_PATH_MAX",
    "AdminConfig",
    "AgentConfig",
    "ArtifactsConfig",
    "Config",
    "ConfigError",
    "ConfigProblem",
    "EmbeddedMeshConfig",
    "EventsConfig",
    "InboxConfig",
    "StorageConfig",
    "KeystoreConfig",
    "LoggingConfig",
    "MeshConfig",
    "NodeConfig",
    "ObservabilityConfig",
    "ProtectionsConfig",
    "RegistryConfig",
    "ServicesConfig",
    "default_config_path",
    "default_data_dir",
    "default_admin_socket",
    "describe_sources",
    "settings_problems",
    "format_duration",
    "format_size",
    "is_system_service",
    "load_config",
    "parse_duration",
    "parse_size",
    "resolve_config_path",
]
