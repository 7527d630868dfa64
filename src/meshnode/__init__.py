"""meshnode: the AgentMesh node daemon."""

__version__ = "0.1.0"
PROTOCOL_VERSION = "0.3.0"
