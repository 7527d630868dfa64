"""Hostile bodies at a real daemon's A2A endpoint (one daemon for the module).

Hypothesis throws malformed JSON-RPC at ``/agents/<name>``: garbage bytes,
broken and deeply nested JSON, every method with wrong types and huge values,
messages with hostile parts and metadata, and mesh envelopes that are garbled,
forged, unsigned claims with hostile members, or correctly signed over the
wrong thing. Invariants, per case:

* never an HTTP 500 and never a JSON-RPC internal error (-32603): an answer
  is a structured JSON-RPC object (``result`` or ``error`` with an integer
  ``code`` and a string ``message``), HTTP 200, 401 (with one of the five
  stable codes) or 413;
* no handler runs for a refused message: the exposed agent's ``dispatched``
  counter does not move for an answer without a result;
* afterwards the daemon still serves (a card, a real call) and logged no
  traceback.

Bounded cases in CI; ``MESHNODE_FUZZ_LONG=1`` runs 50x as many and
``MESHNODE_FUZZ_EXAMPLES=N`` sets the count (the same knobs as the other
fuzz tests). Deadlines are off: a slow shared machine is not a failure.
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import nacl.signing
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meshnode.protocol.a2a_extension import (
    EXTENSION_URI,
    build_envelope_claims,
    sign_envelope,
    unsecured_envelope,
)
from meshnode.protocol.nkeys import KeyPair, decode_seed
from meshnode.testing import DaemonProcess, DaemonSet, eventually

pytestmark = pytest.mark.integration

LONG = os.environ.get("MESHNODE_FUZZ_LONG", "") not in ("", "0")
_OVERRIDE = os.environ.get("MESHNODE_FUZZ_EXAMPLES")


def fuzz_settings(ci_examples: int) -> settings:
    """``ci_examples`` cases in CI, 50x in a long run; no deadline (shared machine)."""
    examples = int(_OVERRIDE) if _OVERRIDE else (ci_examples * 50 if LONG else ci_examples)
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=False,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    )


APP = "fz"
CALLER = KeyPair.generate()
CALLER_KEY = nacl.signing.SigningKey(decode_seed(CALLER.seed)[1])
STRANGER_KEY = nacl.signing.SigningKey(b"\x09" * 32)
AGENT = "echo"
METHODS = [
    "SendMessage", "SendStreamingMessage", "GetTask", "CancelTask", "SubscribeToTask", "ListTasks",
    "CreateTaskPushNotificationConfig", "GetTaskPushNotificationConfig", "GetExtendedAgentCard",
]
AUTH_CODES = {
    "mesh.audience-mismatch", "mesh.audience-missing", "mesh.signature-invalid",
    "mesh.envelope-expired", "mesh.body-mismatch",
}
INTERNAL_ERROR = -32603
ACTIVATED = {"A2A-Version": "1.0", "A2A-Extensions": EXTENSION_URI}


class Target:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        # The bridge listens on port 0: its Status names the port it bound.
        self.url = f"{daemon.status()['a2a']['url']}/agents/{AGENT}"
        self.http = httpx.Client(timeout=60)

    def settle(self, timeout: float = 60.0) -> int:
        """Wait until no bridge task runs; the agent's handler runs then."""
        eventually(lambda: self.counters()[1] == 0, timeout=timeout, what="no bridge task running")
        dispatched, running = self.counters()
        assert running == 0, "bridge tasks still running"
        return dispatched

    def counters(self) -> tuple[int, int]:
        """(the agent's handler runs, the bridge's running tasks)."""
        status = self.daemon.status()
        agent = next(a for a in status["agents"] if a["name"] == AGENT)
        return int(agent["counters"].get("dispatched", 0)), int(status["a2a"]["running_tasks"])


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    daemons = DaemonSet()
    try:
        daemon = daemons.embedded(
            "a2afz",
            agents={AGENT: {"plugin": "echo"}},
            extra={
                "a2a": {"listen": "127.0.0.1:0", "expose": [AGENT], "application": APP,
                        "send_wait": "5s"},
                "a2a.issuers.caller": {"key": CALLER.public_key},
            },
        )
        found = Target(daemon)
        yield found
        found.http.close()
    finally:
        daemons.close()


# --- strategies ---------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**53, -(2**53), 2**63, 2**64 + 1, 10**400, -1, 0]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    st.sampled_from(["", "\x00", "\u2028", "\ud7ff", "A" * 70_000, "TASK_STATE_COMPLETED", "ROLE_USER"]),
)
json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20,
)


def _nested(depth: int, leaf: Any = 1) -> Any:
    value: Any = leaf
    for _ in range(depth):
        value = [value]
    return value


parts = st.one_of(
    st.builds(lambda t: {"text": t}, json_values),
    st.builds(lambda d: {"data": d}, json_values),
    st.builds(lambda d: {"data": d}, st.integers(1, 400).map(_nested)),
    st.builds(lambda f: {"url": f, "mediaType": "text/plain"}, json_values),
    st.builds(lambda b: {"raw": b}, st.one_of(json_values, st.binary(max_size=20).map(lambda x: base64.b64encode(x).decode()))),
    st.dictionaries(st.sampled_from(["text", "data", "url", "raw", "metadata", "mediaType", "filename"]), json_values, max_size=3),
    json_values,
)


def _often(draw: st.DrawFn, n: int) -> bool:
    """True n times in n+1 (the rare value mid-range: Hypothesis favours 0)."""
    return bool(draw(st.integers(0, n)) != n // 2 + 1 if n > 1 else draw(st.integers(0, n)) != 1)


def _b64(obj: Any) -> str:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj, default=str).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@st.composite
def envelopes(draw: st.DrawFn, message: dict[str, Any]) -> Any:
    """A garbled, forged, unsigned-with-hostile-members or signed-but-wrong envelope."""
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(json_values)
    if kind == 1:  # three base64 segments of anything
        return ".".join(_b64(draw(st.one_of(json_values, st.binary(max_size=40)))) for _ in range(3))
    try:
        claims = build_envelope_claims(
            issuer="caller", audience=APP, now=time.time(), message=message,
            call_chain=[{"application": "caller", "start": "plan"}],
        )
    except (ValueError, RecursionError):  # no canonical form: no body hash to sign
        claims = {"issuer": "caller", "audience": APP, "bodyHash": "sha256:" + "0" * 64}
    members = st.sampled_from(["issuer", "audience", "issuedAt", "expiresIn", "bodyHash", "budget", "deadline",
                               "origin", "callChain", "schema"])
    claims.update(draw(st.dictionaries(members, json_values, max_size=3)))
    if kind == 2:  # a claim, any members
        try:
            return unsecured_envelope(claims)
        except (TypeError, ValueError, RecursionError):
            return "x.y."
    key = CALLER_KEY if kind in (3, 4) else STRANGER_KEY
    try:
        token = sign_envelope(claims, key)
    except (TypeError, ValueError, RecursionError):
        return "x.y.z"
    if kind == 4:  # signed by the trusted caller, then one byte flipped
        i = draw(st.integers(0, len(token) - 1))
        token = token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1:]
    return token


@st.composite
def messages(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        return draw(good_messages())
    msg: dict[str, Any] = {}
    fields = {
        "messageId": st.one_of(st.uuids().map(str), json_values),
        "role": st.one_of(st.sampled_from(["ROLE_USER", "ROLE_AGENT", "ROLE_UNSPECIFIED"]), json_values),
        "parts": st.one_of(st.lists(parts, max_size=3), json_values),
        "taskId": json_values,
        "contextId": json_values,
        "referenceTaskIds": json_values,
        "extensions": json_values,
    }
    for name, strategy in fields.items():
        if _often(draw, 3) or name in ("messageId", "parts"):
            msg[name] = draw(strategy)
    meta: dict[str, Any] = draw(st.dictionaries(st.sampled_from(["skill", "x"]), json_values, max_size=2))
    if _often(draw, 3):
        meta[EXTENSION_URI] = draw(st.one_of(
            json_values, envelopes(msg).map(lambda token: {"envelope": token}),
            envelopes(msg).map(lambda token: {"envelope": token}),
        ))
    if bool(meta) or draw(st.booleans()):  # bool(): mypy types draw() here by meta's type
        msg["metadata"] = meta if draw(st.integers(0, 4)) else draw(json_values)
    return msg if draw(st.integers(0, 9)) != 5 else draw(json_values)


@st.composite
def good_messages(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed message, its data anything, now and then an envelope that
    is valid but for hostile members (or not at all)."""
    msg: dict[str, Any] = {
        "messageId": str(uuid.uuid4()),
        "role": "ROLE_USER",
        "parts": [draw(st.one_of(st.builds(lambda d: {"data": d}, json_values),
                                 st.builds(lambda t: {"text": t}, st.text(max_size=50))))],
    }
    if _often(draw, 2):
        members = st.sampled_from(["budget", "deadline", "origin", "callChain", "expiresIn", "schema"])
        hostile = draw(st.dictionaries(members, json_values, max_size=2))
        try:
            claims = build_envelope_claims(issuer="caller", audience=APP, now=time.time(), message=msg)
            claims.update(hostile)
            token = sign_envelope(claims, CALLER_KEY) if draw(st.booleans()) else unsecured_envelope(claims)
        except (TypeError, ValueError, RecursionError):
            token = draw(envelopes(msg))
        msg["metadata"] = {EXTENSION_URI: {"envelope": token}}
    return msg


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if _often(draw, 3):
        headers["A2A-Version"] = "1.0" if _often(draw, 6) else draw(st.sampled_from(["0.3", "", "9"]))
    if _often(draw, 3):
        headers["A2A-Extensions"] = draw(st.sampled_from([EXTENSION_URI, f"x, {EXTENSION_URI}", "bogus"]))
    if draw(st.integers(0, 3)) == 2:
        token = draw(envelopes({"method": "GetTask", "id": "t"}))
        # Header values are latin-1 on the wire: anything else is sent base64'd.
        value = token if isinstance(token, str) and token.isascii() and token.isprintable() else _b64(token)
        # Bounded: an oversized header is the HTTP server's refusal (checked once, below).
        headers["AGBoss-Mesh-Envelope"] = value[:4096]
    # The rare shapes sit mid-range: Hypothesis draws 0 (and shrinks to it) often.
    shape = draw(st.integers(0, 15))
    if shape == 7:
        return draw(st.binary(max_size=300)), headers
    if shape == 8:
        depth = draw(st.integers(100, 20_000))
        return (b'{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":' + b"[" * depth + b"]" * depth + b"}"), headers
    if shape == 9:
        text = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                             "params": {"message": {"messageId": "m", "parts": []}}})
        cut = draw(st.integers(0, len(text)))
        return text[:cut], headers
    # Mostly messages (where the envelope checks and the agent are), any method now and then.
    method = draw(st.sampled_from(["SendMessage"] * 5 + ["SendStreamingMessage"] * 2 + METHODS + ["?"]))
    if method == "?":
        method = draw(json_values)
    params: Any
    if method in ("SendMessage", "SendStreamingMessage") and draw(st.integers(0, 5)):
        params = {"message": draw(messages())}
        if draw(st.booleans()):
            params["configuration"] = draw(st.one_of(
                st.fixed_dictionaries({}, optional={
                    "returnImmediately": json_values, "acceptedOutputModes": json_values,
                    "historyLength": json_values, "pushNotificationConfig": json_values,
                }),
                json_values,
            ))
    elif method in ("GetTask", "CancelTask", "SubscribeToTask") and draw(st.integers(0, 3)):
        params = {"id": draw(st.one_of(st.uuids().map(str), json_values))}
    else:
        params = draw(json_values)
    doc: dict[str, Any] = {"jsonrpc": "2.0" if _often(draw, 6) else draw(json_values), "method": method}
    if _often(draw, 5):
        doc["id"] = draw(st.integers(0, 2**31)) if _often(draw, 4) else draw(json_values)
    if _often(draw, 5):
        doc["params"] = params
    if draw(st.integers(0, 9)) == 5:
        return _dumps([doc, doc]), headers  # a batch
    return _dumps(doc), headers


def _dumps(doc: Any) -> bytes:
    try:
        return orjson.dumps(doc)
    except TypeError:  # integers beyond 64 bits
        return json.dumps(doc).encode()


# --- invariants ---------------------------------------------------------------------


def _check_rpc(doc: Any, status: int) -> bool:
    """A structured JSON-RPC answer; True when it carries a result."""
    assert isinstance(doc, dict), doc
    if "result" in doc:
        assert status == 200
        return True
    error = doc.get("error")
    assert isinstance(error, dict), doc
    assert isinstance(error.get("code"), int) and isinstance(error.get("message"), str), error
    assert error["code"] != INTERNAL_ERROR, f"an internal error: {error}"
    if status == 401:
        assert error["data"][0]["metadata"]["code"] in AUTH_CODES, error
    return False


def _json(raw: str | bytes) -> object:
    """Parse an answer: a JSON-RPC id may be an integer past a double's range (echoed as
    sent), which orjson refuses; the standard parser keeps it exact."""
    return json.loads(raw)


def _check(answer: httpx.Response) -> bool:
    """Invariants on one HTTP answer; True when something was accepted."""
    assert answer.status_code in (200, 401, 413), (answer.status_code, answer.text[:300])
    if answer.status_code == 413:
        return False
    kind = answer.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        accepted = False
        for line in answer.text.split("\n"):  # not splitlines(): U+2028 is no SSE line break
            if line.startswith("data:"):
                accepted = _check_rpc(_json(line[5:]), answer.status_code) or accepted
        return accepted
    doc = _json(answer.content)
    if isinstance(doc, list):  # a batch answer
        results = [_check_rpc(item, answer.status_code) for item in doc]  # every item checked
        return any(results)
    return _check_rpc(doc, answer.status_code)


def test_a2a_endpoint_survives_hostile_bodies(target: Target) -> None:
    tally: Counter[str] = Counter()

    # Two fixed cases, so both refusal paths are exercised in every run whatever
    # the generator draws: a garbled envelope (401) and a method that is not one.
    garbled = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": {
        "messageId": "fixed-401", "role": "ROLE_USER", "parts": [{"text": "hi"}],
        "metadata": {EXTENSION_URI: {"envelope": "not.a.jws"}}}}}
    unknown = {"jsonrpc": "2.0", "id": 2, "method": "NoSuchMethod", "params": {}}

    @fuzz_settings(200)
    @given(case=bodies())
    @example(case=(json.dumps(garbled).encode(), ACTIVATED))
    @example(case=(json.dumps(unknown).encode(), ACTIVATED))
    def case(case: tuple[bytes, dict[str, str]]) -> None:
        body, headers = case
        # Whatever an earlier case started has ended: count from here.
        baseline = target.settle()
        answer = target.http.post(target.url, content=body, headers=headers)
        accepted = _check(answer)
        tally[f"{answer.status_code}:{'result' if accepted else 'error'}"] += 1
        if os.environ.get("MESHNODE_FUZZ_DEBUG"):
            print(answer.status_code, answer.text[:160])
        if not accepted:
            assert target.counters()[0] == baseline, "a handler ran for a refused message"

    case()
    print(f"A2A fuzz outcomes: {dict(tally)}")
    assert tally["200:error"] > 0 and tally["401:error"] > 0
    # A huge header: the HTTP server refuses it (400, or the connection
    # closed) or it is answered like any other request.
    try:
        big = target.http.post(target.url, content=b"{}", headers={**ACTIVATED, "AGBoss-Mesh-Envelope": "A" * 100_000})
        assert big.status_code == 400 or not _check(big), big.text
    except (httpx.ReadError, httpx.RemoteProtocolError):
        pass
    # Still serving: the card, and a real call that runs the agent.
    assert target.http.get(target.url + "/.well-known/agent-card.json").status_code == 200
    msg = {"messageId": str(uuid.uuid4()), "role": "ROLE_USER", "parts": [{"data": {"alive": True}}]}
    ok = target.http.post(target.url, json={"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                                            "params": {"message": msg}}, headers={"A2A-Version": "1.0"})
    task = ok.json()["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
    daemon = target.daemon
    assert daemon.process is not None and daemon.process.poll() is None, daemon.log_tail()
    assert "Traceback" not in daemon.log_text(), daemon.log_tail()
