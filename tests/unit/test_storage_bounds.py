"""The platform's JetStream bounds (issue #22.3, #22.4): every object bounded, the
mailbox discard-new, the server and account limits written, full stores named."""

from __future__ import annotations

from pathlib import Path

import nats.js.errors
from nats.js.api import DiscardPolicy

from meshnode.services.base import store_full_error
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.errors import ConsumerLimit, StoreFull, translate
from meshnode.transport.serverconf import render_server_config
from meshnode.transport.storeusage import BoundedStream, StoreUsage
from meshnode.transport.streams import (
    DEFAULT_STREAM_LIMITS,
    StreamLimits,
    agreements_bucket_config,
    artifact_buckets,
    feed_state_bucket_config,
    feed_stream_config,
    inbox_stream_config,
    mesh_stream_configs,
    registry_bucket_config,
    tasks_bucket_config,
)

MIB = 1024 * 1024
AGENT = "UCY5Q3LMP6Y4ANE76KBUQ2QNYBOFS6EWW6ZOMHZRI7X46LPTBTDH72BM"


def test_every_platform_stream_and_bucket_is_bounded_and_reserves_its_share() -> None:
    limits = StreamLimits(tasks=3 * MIB, max_msg_size=4096)
    streams = {c.name: c for c in [*mesh_stream_configs(1, limits), feed_stream_config(1, limits)]}
    for config in streams.values():
        assert config.max_bytes and config.max_bytes > 0, config.name
        assert config.discard == DiscardPolicy.OLD  # a flood evicts history, never blocks the stream
    assert streams["MESH_TASKS"].max_bytes == 3 * MIB
    for name in ("MESH_TASKS", "MESH_EVENTS", "MESH_FEED", "MESH_HEARTBEAT"):
        assert streams[name].max_msg_size == 4096, name  # participant-writable
    store, index, uploads = artifact_buckets(1, limits)
    buckets = [registry_bucket_config(1, limits), tasks_bucket_config(1, limits),
               feed_state_bucket_config(1, limits), agreements_bucket_config(1, limits), index, uploads]
    assert all(b.max_bytes and b.max_bytes > 0 for b in buckets)
    assert store.max_bytes == limits.artifacts
    assert DEFAULT_STREAM_LIMITS.platform_total() == 808 * MIB  # the consumer ceiling reserves no bytes
    # Consumers: set on every stream that holds one per agent or per task
    # (nats-server 2.15 caps a stream that sets none at 1,000).
    for name in ("MESH_TASKS", "MESH_EVENTS", "MESH_FEED"):
        assert streams[name].max_consumers == DEFAULT_STREAM_LIMITS.max_consumers > 1000, name
    assert StreamLimits(max_consumers=7).max_consumers == 7


def test_a_mailbox_refuses_new_mail_at_its_bound_instead_of_evicting() -> None:
    config = inbox_stream_config(AGENT, max_bytes=2 * MIB, max_msgs=10)
    assert config.discard == DiscardPolicy.NEW
    assert (config.max_bytes, config.max_msgs, config.no_ack) == (2 * MIB, 10, True)


def _conf(**kw: object) -> str:
    return render_server_config(
        server_name="s", host="127.0.0.1", port=0, monitor_port=None, max_payload=1024,
        max_control_line=4096, operator_jwt="o", system_account="A", account_jwts={},
        store_dir=Path("/tmp/x"), ports_file_dir=Path("/tmp/y"), **kw,  # type: ignore[arg-type]
    )


def test_jetstream_max_store_is_written_into_the_server_config() -> None:
    assert "  max_file_store: 67108864\n" in _conf(max_file_store=64 * MIB)
    assert "max_file_store" not in _conf()


def test_each_tenant_account_gets_its_share_of_the_store(tmp_path: Path) -> None:
    split = EmbeddedNatsServer(tmp_path, max_store=90 * MIB, tenants=["a", "b"])
    assert split.account_store_limit() == 30 * MIB
    explicit = EmbeddedNatsServer(tmp_path, max_store=90 * MIB, account_max_store=50 * MIB)
    assert explicit.account_store_limit() == 50 * MIB
    assert EmbeddedNatsServer(tmp_path).account_store_limit() == -1


def _api_error(code: int, err_code: int, description: str) -> nats.js.errors.APIError:
    exc = nats.js.errors.APIError(code=code, err_code=err_code, description=description)
    return exc


def test_insufficient_resources_is_a_full_store_answered_quota_exceeded() -> None:
    for code, err_code, text in ((503, 10023, "insufficient resources"),
                                 (503, 10077, "maximum bytes exceeded"),
                                 (400, 10047, "insufficient storage resources available")):
        err = translate(_api_error(code, err_code, text))
        assert isinstance(err, StoreFull) and err.err_code == err_code
    answer = store_full_error("registry", StoreFull("insufficient resources", code=503, err_code=10023))
    assert answer["code"] == "QUOTA_EXCEEDED"
    assert "JetStream store" in answer["message"] and "jetstream_max_store" in answer["message"]
    assert answer["details"] == {"store": "jetstream", "service": "registry", "err_code": 10023}


def test_a_stream_at_its_consumer_ceiling_is_its_own_error() -> None:
    err = translate(_api_error(400, 10026, "maximum consumers limit reached"))
    assert isinstance(err, ConsumerLimit) and not isinstance(err, StoreFull)


def test_store_pressure_names_the_store_and_headroom_is_what_is_left() -> None:
    usage = StoreUsage(
        used=10 * MIB, reserved=85 * MIB, limit=100 * MIB,
        streams=(BoundedStream("MESH_TASKS", 9 * MIB, 10 * MIB, 5, discards_old=True),
                 BoundedStream("KV_mesh_registry", 1 * MIB, 10 * MIB, 3),
                 BoundedStream("KV_mesh_tasks", 9 * MIB, 10 * MIB, 3)),
    )
    reasons = usage.pressure(0.8)
    assert [r.split(":")[0] for r in reasons] == ["account store", "stream MESH_TASKS", "stream KV_mesh_tasks"]
    assert "reserved" in reasons[0]
    # What a full stream does, said as it is: a platform stream goes on taking
    # writes and loses its oldest; a bucket (or a mailbox) refuses writes.
    assert reasons[1].endswith("full, it drops its oldest messages")
    assert reasons[2].endswith("full, it refuses writes")
    assert all(r.count("full, it") <= 1 for r in reasons), reasons  # said once (it was said twice)
    assert usage.headroom == 15 * MIB
    assert StoreUsage(used=1, reserved=0, limit=-1).headroom is None
    assert StoreUsage(used=1, reserved=0, limit=-1).pressure(0.8) == []


def test_a_mesh_whose_clients_never_ack_may_choose_the_earlier_eviction() -> None:
    from meshnode.config import Config

    assert Config().inbox.buffer_discard == "new"
    assert Config.model_validate({"inbox": {"buffer_discard": "old"}}).inbox.buffer_discard == "old"
    assert inbox_stream_config(AGENT, discard="old").discard == DiscardPolicy.OLD
