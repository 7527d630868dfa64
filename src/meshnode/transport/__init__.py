"""The NATS transport binding (AgentMesh §18): connection, credentials, the broker.

Submodules: ``connection`` (the node's one NATS connection), ``jwt`` (the
operator → account → user JWT chain and creds files), ``permissions`` (the
§14.3 grants of a roster) and ``embedded`` (the supervised local nats-server of
an embedded mesh).
"""
