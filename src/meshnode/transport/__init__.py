"""The NATS transport binding (AgentMesh §18): connection, JetStream, credentials, the broker.

Nothing above this package imports ``nats``: it offers transport-level types
and errors instead.

Submodules: ``connection`` (the node's one NATS connection), ``messages``
(:class:`~.messages.Message`, :class:`~.messages.Subscription`), ``jetstream``
(the JetStream facade: mailbox buffer, durable consumers, KV, stream reads),
``streams`` (the §18.3/§18.4 streams and buckets, provisioned idempotently),
``errors`` (the transport error taxonomy), ``jwt`` (the operator → account →
user JWT chain and creds files), ``permissions`` (the §14.3 grants of a
roster), ``embedded`` (the supervised local nats-server of an embedded mesh)
with ``tenants``, ``meshkeys``, ``serverconf`` and ``files``, and ``cluster``
(a routed cluster of them on one host).
"""
