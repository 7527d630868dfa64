"""Soak: mixed traffic for a long time, with agents added and removed, watching for leaks.

``python -m benchmarks soak --minutes 60`` runs two real daemons (a hub with
the embedded mesh, a joined node) and, for the given time, keeps several
callers busy with a mix of operations through the admin API:

* requests across nodes both ways and on the same node (echo), streamed
  answers (wordstream, ``config.stream``), deferred tasks (longtask),
  admission refusals (an offering nobody offers, an input the schema refuses);
* churn: every few seconds an agent is added on the node (``Agents.Add``, which
  re-mints the credential and reconnects), called from the hub, and removed
  (``Agents.Remove``, deregistering it and deleting its broker buffer).

Every couple of seconds it samples both daemons: asyncio tasks, open file
descriptors, RSS and threads (``Metrics`` → ``runtime``). The baseline is
taken after a warm-up, with traffic paused and the churned agent removed;
the final sample the same way after the run. A leak shows as a final value
well above the baseline. The run also counts every operation's outcome:
``unexpected`` are outcomes other than the one the operation must produce;
``timeout`` are calls reported failed to the caller for want of an answer in
time (TRANSPORT_TIMEOUT), which the churn's reconnects can cause. At the end
it counts the ERROR lines in both daemons' logs: a platform service failing
behind the callers' backs (a full task store) shows only there; and it lists
the WARNING lines by kind, so a warning that routine work raises shows.

The short variant runs in CI (tests/soak/test_soak_short.py); results of a
run are written to ``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import random
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from meshnode.testing import DaemonProcess, DaemonSet

__all__ = ["SoakResult", "run", "soak"]

GAUGES = ("asyncio_tasks", "open_fds", "rss_bytes", "threads")


@dataclass
class SoakResult:
    seconds: float
    operations: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    timeouts: list[str] = field(default_factory=list)
    churn_cycles: int = 0
    baseline: dict[str, dict[str, float]] = field(default_factory=dict)
    final: dict[str, dict[str, float]] = field(default_factory=dict)
    peak: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    #: Per daemon: ERROR lines in its log, counted by logger, and the first few in full.
    errors_logged: dict[str, dict[str, int]] = field(default_factory=dict)
    first_errors: dict[str, list[str]] = field(default_factory=dict)
    #: Per daemon: WARNING lines in its log, counted by kind (logger and gist).
    warnings_logged: dict[str, dict[str, int]] = field(default_factory=dict)

    def growth(self, node: str, gauge: str) -> float:
        return self.final[node][gauge] - self.baseline[node][gauge]

    def count(self, suffix: str) -> int:
        """Operations that ended ``:unexpected`` or ``:timeout``."""
        return sum(n for op, n in self.operations.items() if op.endswith(f":{suffix}"))


_ERROR_LINE = re.compile(r"^\S+ \S+ ERROR\s+(\S+): (.*)$")


def _errors_logged(daemon: DaemonProcess, keep: int = 3) -> tuple[dict[str, int], list[str]]:
    """ERROR lines of ``daemon``'s log by logger, and the first ``keep`` of them.

    The outcome counters see what callers see; a platform service failing behind
    a caller's back (a task record that cannot be written) shows only here.
    """
    counts: Counter[str] = Counter()
    first: list[str] = []
    for line in daemon.log_text().splitlines():
        found = _ERROR_LINE.match(line)
        if found is None:
            continue
        counts[found.group(1)] += 1
        if len(first) < keep:
            first.append(line[:300])
    return dict(counts), first


_WARNING_LINE = re.compile(r"^\S+ \S+ WARNING\s+(\S+): (.*)$")
_AGENT_LOGGER = re.compile(r"^meshnode\.agent\..*")
_SPECIFIC = re.compile(r"\S*\d\S*|\b[A-Z2-7]{20,}\b")  # ids, keys, counts, times


def warnings_logged(log_text: str, words: int = 6) -> dict[str, int]:
    """WARNING lines of a daemon's log by kind: the logger (every agent's as
    one) and the message's first ``words`` words, ids and numbers blanked.

    Not a failure: some warnings are the point of the run (a full store
    reported). A warning that comes with routine work (one after every
    roster change) is a defect an operator would learn to ignore; this makes
    it show in the report.
    """
    counts: Counter[str] = Counter()
    for line in log_text.splitlines():
        found = _WARNING_LINE.match(line)
        if found is None:
            continue
        logger = _AGENT_LOGGER.sub("meshnode.agent.*", found.group(1))
        gist = " ".join(_SPECIFIC.sub("#", found.group(2)).split()[:words])
        counts[f"{logger}: {gist}"] += 1
    return dict(counts)


def _gauges(daemon: DaemonProcess) -> dict[str, float]:
    runtime = daemon.admin("Metrics", timeout=30)["runtime"]
    return {k: float(runtime[k]) for k in GAUGES if runtime.get(k) is not None}


def _settled(daemons: dict[str, DaemonProcess], samples: int = 3, pause: float = 0.5) -> dict[str, dict[str, float]]:
    """The median of a few samples per daemon (one admin call is itself a task and an fd)."""
    taken: dict[str, list[dict[str, float]]] = {name: [] for name in daemons}
    for _ in range(samples):
        for name, daemon in daemons.items():
            taken[name].append(_gauges(daemon))
        time.sleep(pause)
    return {name: {g: statistics.median(s[g] for s in rows) for g in rows[0]} for name, rows in taken.items()}


class _Traffic:
    """Callers and churn on background threads, each op checked against its expected outcome."""

    def __init__(self, hub: DaemonProcess, node: DaemonProcess, result: SoakResult, seed: int) -> None:
        self.hub, self.node, self.result = hub, node, result
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.stop_all = threading.Event()
        self.threads: list[threading.Thread] = []
        self.ids = {
            "hub_echo": hub.agent_id("echo"),
            "node_echo": node.agent_id("echo"),
            "node_words": node.agent_id("words"),
            "node_count": node.agent_id("count"),
        }
        self.churn_every_s = 4.0
        self.in_flight = 0  # operations and churn cycles started and not yet finished

    def _record(self, op: str, ok: bool, detail: Any) -> None:
        timed_out = isinstance(detail, dict) and (detail.get("error") or {}).get("code") == "TRANSPORT_TIMEOUT"
        with self.lock:
            if ok:
                self.result.operations[op] += 1
            elif timed_out:
                # Reported failed to its caller (no answer within its timeout), which
                # the churn's reconnects make possible: counted apart from the wrong answers.
                self.result.operations[f"{op}:timeout"] += 1
                if len(self.result.timeouts) < 50:
                    self.result.timeouts.append(f"{op}: {str(detail)[:300]}")
            else:
                self.result.operations[f"{op}:unexpected"] += 1
                if len(self.result.unexpected) < 50:
                    self.result.unexpected.append(f"{op}: {str(detail)[:300]}")

    def _ops(self) -> list[tuple[str, Callable[[], tuple[bool, Any]]]]:
        hub, node, ids = self.hub, self.node, self.ids

        def completed(r: dict[str, Any], want: Any = None) -> tuple[bool, Any]:
            return (r.get("status") == "completed" and (want is None or r.get("output") == want)), r

        def refused(r: dict[str, Any], code: str) -> tuple[bool, Any]:
            return (r.get("status") == "failed" and (r.get("error") or {}).get("code") == code), r

        def text(n: int) -> str:
            return " ".join(f"w{i}" for i in range(n))

        return [
            ("remote-echo", lambda: completed(hub.call(ids["node_echo"], "echo", {"n": 1}), {"ok": {"n": 1}})),
            ("remote-echo-back", lambda: completed(node.call(ids["hub_echo"], "echo", "x"), {"ok": "x"})),
            ("local-echo", lambda: completed(node.call("echo", "echo", [1, 2]), {"ok": [1, 2]})),
            ("big-echo", lambda: completed(hub.call(ids["node_echo"], "echo", "y" * 20_000))),
            ("stream", lambda: completed(hub.admin("Call", {
                "agent": ids["node_words"], "offering": "words", "input": {"text": text(20)},
                "config": {"stream": True}, "timeout": 30}, timeout=40))),
            ("task", lambda: completed(hub.call(ids["node_count"], "count", {"to": 2, "every": 0.05}))),
            ("no-such-offering", lambda: refused(hub.call(ids["node_echo"], "nope"), "OFFERING_NOT_FOUND")),
            ("schema-refusal", lambda: refused(hub.call(ids["node_words"], "words", {"text": 5}), "INPUT_INVALID")),
        ]

    def _caller(self, index: int) -> None:
        rng = random.Random(self.rng.random() + index)
        ops = self._ops()
        while not self.stop_all.is_set():
            if not self.running.wait(0.2):
                continue
            name, op = rng.choice(ops)
            with self.lock:
                self.in_flight += 1
            try:
                ok, detail = op()
            except Exception as exc:  # an admin error is an unexpected outcome, not a crash of the soak
                ok, detail = False, exc
            finally:
                with self.lock:
                    self.in_flight -= 1
            self._record(name, ok, detail)

    def _churn(self) -> None:
        k = 0
        while not self.stop_all.is_set():
            if not self.running.wait(0.2):
                continue
            name = f"churn{k % 3}"
            k += 1
            with self.lock:
                self.in_flight += 1
            try:
                self.node.admin("Agents.Add", {"name": name, "config": {"plugin": "echo"}}, timeout=60)
                agent_id = self.node.agent_id(name)
                ok, detail = self._call_new(agent_id)
                self._record("churn-call", ok, detail)
                self.node.admin("Agents.Remove", {"name": name}, timeout=60)
                with self.lock:
                    self.result.churn_cycles += 1
            except Exception as exc:
                self._record("churn", False, exc)
            finally:
                with self.lock:
                    self.in_flight -= 1
            self.stop_all.wait(self.churn_every_s)

    def _call_new(self, agent_id: str) -> tuple[bool, Any]:
        result = self.hub.call(agent_id, "echo", "hello", timeout=30)
        return result.get("status") == "completed", result

    def start(self, callers: int) -> None:
        self.threads = [threading.Thread(target=self._caller, args=(i,), daemon=True) for i in range(callers)]
        self.threads.append(threading.Thread(target=self._churn, daemon=True))
        for thread in self.threads:
            thread.start()

    def pause(self) -> None:
        """Stop issuing new operations; wait for the ones in flight (and any churn cycle) to finish.

        By condition, not by a fixed wait: a caller's operation has returned, and
        no churned agent is left on the node. What the daemons still do for those
        operations afterwards (a task record settling) is for the final sample's
        own settling (:func:`soak`'s ``settle_within``)."""
        self.running.clear()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with self.lock:
                busy = self.in_flight
            if not busy and not any(name.startswith("churn") for name in (a["name"] for a in self.node.status()["agents"])):
                return
            time.sleep(0.2)

    def close(self) -> None:
        self.stop_all.set()
        self.running.set()
        for thread in self.threads:
            thread.join(timeout=120)


def soak(
    seconds: float,
    *,
    warmup_s: float | None = None,
    callers: int = 3,
    sample_every_s: float = 2.0,
    seed: int = 10,
    progress: Callable[[str], None] | None = None,
    settle_within: dict[str, float] | None = None,
    settle_timeout_s: float = 60.0,
) -> SoakResult:
    """Run the soak for ``seconds`` of measured traffic (after a warm-up) and return its result.

    ``settle_within`` (gauge -> the growth a run may keep) makes the final sample
    wait, up to ``settle_timeout_s``, until every daemon's growth is within it:
    with traffic paused, what the daemons still finish (tasks of answered calls,
    a periodic pass) comes back down, however slow the machine, while a leak
    stays up and is still reported by the final sample.
    """
    say = progress or (lambda _m: None)
    warmup = warmup_s if warmup_s is not None else min(60.0, max(8.0, seconds * 0.2))
    result = SoakResult(seconds=seconds)
    daemons = DaemonSet()
    try:
        hub = daemons.embedded("soak-hub", agents={"echo": {"plugin": "echo"}})
        node = daemons.joined("soak-node", via=hub, agents={
            "echo": {"plugin": "echo"}, "words": {"plugin": "wordstream"}, "count": {"plugin": "longtask"},
        })
        both = {"hub": hub, "node": node}
        traffic = _Traffic(hub, node, result, seed)
        traffic.start(callers)
        say(f"warm-up {warmup:.0f} s")
        traffic.running.set()
        time.sleep(warmup)
        traffic.pause()
        result.baseline = _settled(both)
        say(f"baseline {result.baseline}")
        result.peak = {name: dict(g) for name, g in result.baseline.items()}
        traffic.running.set()
        started = time.monotonic()
        next_report = started + 60
        while (elapsed := time.monotonic() - started) < seconds:
            time.sleep(min(sample_every_s, max(0.0, seconds - elapsed)))
            row: dict[str, Any] = {"t": round(time.monotonic() - started, 1)}
            for name, daemon in both.items():
                gauges = _gauges(daemon)
                row[name] = gauges
                for g, v in gauges.items():
                    result.peak[name][g] = max(result.peak[name].get(g, v), v)
            result.samples.append(row)
            if time.monotonic() >= next_report:
                next_report += 60
                say(f"{row['t']:.0f} s: {dict(result.operations)} churn {result.churn_cycles} | {row}")
        traffic.pause()
        result.final = _settled(both)
        settle_by = time.monotonic() + settle_timeout_s
        while settle_within and time.monotonic() < settle_by and any(
            result.growth(name, g) > bound for name in both for g, bound in settle_within.items()
        ):
            time.sleep(0.5)
            result.final = _settled(both)
        traffic.close()
        for name, daemon in both.items():
            result.errors_logged[name], result.first_errors[name] = _errors_logged(daemon)
            result.warnings_logged[name] = warnings_logged(daemon.log_text())
            if daemon.process is None or daemon.process.poll() is not None:
                result.unexpected.append(f"daemon {name} exited")
                result.operations["daemon-exit:unexpected"] += 1
    finally:
        daemons.close()
    return result


def report(result: SoakResult) -> str:
    lines = [f"soak {result.seconds:.0f} s: {sum(result.operations.values())} operations, "
             f"{result.churn_cycles} add/remove cycles, {result.count('unexpected')} unexpected outcomes, "
             f"{result.count('timeout')} reported to the caller as timed out"]
    for name in result.baseline:
        parts = []
        for g in GAUGES:
            if g in result.baseline[name] and g in result.final.get(name, {}):
                b, f, p = result.baseline[name][g], result.final[name][g], result.peak[name][g]
                unit = 1 / 1048576 if g == "rss_bytes" else 1
                parts.append(f"{g} {b * unit:.0f} -> {f * unit:.0f} (peak {p * unit:.0f})")
        lines.append(f"  {name}: " + ", ".join(parts) + ("  [rss in MiB]" if parts else ""))
    for name, by_logger in result.errors_logged.items():
        if by_logger:
            listed = ", ".join(f"{logger} {n:,}" for logger, n in sorted(by_logger.items(), key=lambda kv: -kv[1]))
            lines.append(f"  {name}: {sum(by_logger.values()):,} ERROR lines logged ({listed})")
            lines.extend(f"    {line}" for line in result.first_errors.get(name, []))
        else:
            lines.append(f"  {name}: no ERROR line logged")
    for name, by_kind in result.warnings_logged.items():
        if by_kind:
            lines.append(f"  {name}: {sum(by_kind.values()):,} WARNING lines logged, by kind:")
            lines.extend(f"    {n:,} × {kind}" for kind, n in sorted(by_kind.items(), key=lambda kv: -kv[1])[:8])
        else:
            lines.append(f"  {name}: no WARNING line logged")
    for line in result.unexpected[:10]:
        lines.append(f"  unexpected: {line}")
    for line in result.timeouts[:5]:
        lines.append(f"  timed out: {line}")
    return "\n".join(lines)


def run(quick: bool = False, minutes: float = 60.0) -> dict[str, Any]:
    """The benchmark entry: ``--quick`` is a 30-second soak."""
    from .harness import write_result

    seconds = 30.0 if quick else minutes * 60
    result = soak(seconds, progress=lambda m: print(m, flush=True))
    print(report(result))
    payload = asdict(result)
    payload["operations"] = dict(result.operations)
    write_result("soak", payload)
    return payload
