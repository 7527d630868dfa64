"""Observers of a mesh's span, metric and log events (AgentMesh §13.4).

Export is a subscriber's job, not the mesh's: the agents here are ordinary
agents that read the ``mesh.trace.>``/``mesh.metrics.>``/``mesh.log.>``
events other nodes publish (see ``[observability]``) and hand them on.
:mod:`meshnode.observability.otlp` turns span events into OpenTelemetry
spans and exports them over OTLP when ``opentelemetry-sdk`` is installed.
"""
