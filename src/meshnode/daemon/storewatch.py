"""Watches how full the mesh's JetStream store is, on a service node (issue #22.3).

A mesh that runs low on store says so instead of failing with INTERNAL_ERROR:
every ``[storage] check_interval`` this reads the account's use, limit and
reservations and each bounded stream's fill (:mod:`meshnode.transport.storeusage`),
keeps the last reading for ``meshnode status`` and the metrics, and logs once
when something crosses ``[storage] low_store_warning`` (and once when it is
back below), naming the store.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from meshnode.node.periodic import PeriodicJob
from meshnode.transport.jetstream import JetStream
from meshnode.transport.storeusage import DROPS_OLDEST, StoreUsage, read_store_usage

__all__ = ["StoreWatch", "tenant_gauges_text"]

log = logging.getLogger("meshnode.storage")


class StoreWatch:
    """The last store reading of one account and its low-store warnings."""

    def __init__(self, jetstream: JetStream, *, threshold: float, interval_s: float, label: str = "") -> None:
        self._js = jetstream
        #: Whose store, in log lines ("tenant family"); empty for the mesh's own.
        self.label = label
        self.threshold = threshold
        self.usage: StoreUsage | None = None
        self.error: str | None = None
        self.checked_at: int | None = None
        self._warned: set[str] = set()  # stores currently reported low (by name)
        self.job = PeriodicJob("store-watch", self._tick, interval_s, jitter=0.1, first_delay=0.0)

    def start(self) -> None:
        self.job.start()

    async def stop(self) -> None:
        await self.job.stop()

    async def _tick(self) -> None:
        await self.check()

    async def check(self) -> StoreUsage | None:
        """Read the store now; log each store that became low, or recovered, once."""
        try:
            usage = await read_store_usage(self._js)
        except Exception as exc:  # reported in status; the next check retries
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        self.usage, self.error, self.checked_at = usage, None, int(time.time())
        reasons = usage.pressure(self.threshold)
        now_low = {r.split(":", 1)[0]: r for r in reasons}
        for store, reason in now_low.items():
            if store not in self._warned:
                advice = (
                    # A stream that drops its oldest (the task updates, the meter events)
                    # refuses nothing: it keeps less history than it may be meant to.
                    "It keeps what fits: raise its bound in [storage] to keep more history"
                    if reason.endswith(DROPS_OLDEST) else
                    "A full store refuses writes (QUOTA_EXCEEDED); free space or raise [storage] / "
                    "[mesh.embedded] jetstream_max_store"
                )
                log.warning("JetStream store%s low: %s; past %.0f%% ([storage] low_store_warning). %s",
                            self._whose(), reason, self.threshold * 100, advice)
        for store in self._warned - now_low.keys():
            log.info("JetStream store%s no longer low: %s", self._whose(), store)
        self._warned = set(now_low)
        return usage

    def _whose(self) -> str:
        return f" of {self.label}" if self.label else ""

    def snapshot(self) -> dict[str, Any]:
        """The ``storage`` member of Status."""
        usage = self.usage
        reasons = usage.pressure(self.threshold) if usage is not None else []
        return {
            "state": "unknown" if usage is None else ("low" if reasons else "ok"),
            "low": reasons,
            "threshold": self.threshold,
            "checked_at": self.checked_at,
            "error": self.error,
            **(usage.as_dict(self.threshold) if usage is not None else {}),
        }

    def gauges(self) -> dict[str, int]:
        """Prometheus gauges (``meshnode_jetstream_store_*``)."""
        usage = self.usage
        if usage is None:
            return {}
        out = {
            "jetstream_store_used_bytes": usage.used,
            "jetstream_store_reserved_bytes": usage.reserved,
            "jetstream_store_limit_bytes": usage.limit,
            "jetstream_store_low": int(bool(usage.pressure(self.threshold))),
        }
        if usage.headroom is not None:
            out["jetstream_store_headroom_bytes"] = usage.headroom
        return out


def tenant_gauges_text(watches: dict[str, StoreWatch]) -> str:
    """Each tenant's store gauges in the Prometheus text format: one family per
    gauge (``meshnode_tenant_jetstream_store_used_bytes``...), a series per tenant."""
    series: dict[str, list[str]] = {}
    for tenant, watch in sorted(watches.items()):
        for name, value in watch.gauges().items():
            series.setdefault(name, []).append(f'meshnode_tenant_{name}{{tenant="{tenant}"}} {value}\n')
    return "".join(f"# TYPE meshnode_tenant_{name} gauge\n" + "".join(lines) for name, lines in series.items())
