"""The store watch of a tenant's account (daemon/storewatch.py): its warnings
name the tenant, and its gauges are one Prometheus series per tenant."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.daemon import storewatch
from meshnode.daemon.storewatch import StoreWatch, tenant_gauges_text
from meshnode.transport.storeusage import StoreUsage

GIB = 1024**3


async def test_a_tenants_store_is_watched_under_its_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    readings = {"family": StoreUsage(used=int(0.9 * GIB), reserved=GIB // 2, limit=GIB),
                "work": StoreUsage(used=1000, reserved=2000, limit=GIB)}

    async def read(js: Any) -> StoreUsage:
        return readings[js]

    monkeypatch.setattr(storewatch, "read_store_usage", read)
    watches = {name: StoreWatch(name, threshold=0.8, interval_s=60, label=f"tenant {name}")  # type: ignore[arg-type]
               for name in readings}
    with caplog.at_level("WARNING", logger="meshnode.storage"):
        for watch in watches.values():
            await watch.check()
    assert "JetStream store of tenant family low: account store:" in caplog.text
    assert "tenant work" not in caplog.text
    assert watches["family"].snapshot()["state"] == "low" and watches["work"].snapshot()["state"] == "ok"
    text = tenant_gauges_text(watches)
    assert text.count("# TYPE meshnode_tenant_jetstream_store_used_bytes gauge\n") == 1
    assert f'meshnode_tenant_jetstream_store_used_bytes{{tenant="family"}} {int(0.9 * GIB)}\n' in text
    assert 'meshnode_tenant_jetstream_store_low{tenant="family"} 1\n' in text
    assert 'meshnode_tenant_jetstream_store_low{tenant="work"} 0\n' in text
    assert tenant_gauges_text({}) == ""
