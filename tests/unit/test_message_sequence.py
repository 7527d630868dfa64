"""A JetStream delivery's stream sequence (and delivery count), read from its ack
subject: the drain reads it for every buffered copy, so it takes the one token
instead of nats-py's whole metadata parse. It must agree with nats-py on both ack
subject forms."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from meshnode.transport.messages import Message

ACK_SUBJECTS = [
    # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>
    "$JS.ACK.MESH_INBOX_X.inbox_X.3.41.17.1764990000000000000.5",
    # with domain and account hash, without and with the trailing token
    "$JS.ACK._.ACCHASH.MESH_INBOX_X.inbox_X.1.9000000001.8.1764990000000000000.0",
    "$JS.ACK.hub.ACCHASH.MESH_INBOX_X.inbox_X.2.12.8.1764990000000000000.0.rand",
]


@pytest.mark.parametrize("reply", ACK_SUBJECTS)
def test_the_sequence_agrees_with_nats_py(reply: str) -> None:
    msg = Msg(_client=Client(), subject="mesh.agent.x.inbox", reply=reply, data=b"")
    assert Message(msg).sequence == msg.metadata.sequence.stream


@pytest.mark.parametrize("reply", ACK_SUBJECTS)
def test_the_delivery_count_agrees_with_nats_py(reply: str) -> None:
    # The drain hands a copy whose live handler runs back for longer at each delivery.
    msg = Msg(_client=Client(), subject="mesh.agent.x.inbox", reply=reply, data=b"")
    assert Message(msg).deliveries == msg.metadata.num_delivered


def test_a_subject_that_is_no_ack_subject_is_refused_as_nats_py_refuses_it() -> None:
    for reply in ("_INBOX.abc", "$JS.ACK.a.b.c.d", "$JS.ACK.s.c.1.x.1.0.0"):
        msg = Msg(_client=Client(), subject="s", reply=reply, data=b"")
        with pytest.raises(Exception) as ours:
            Message(msg).sequence  # noqa: B018
        with pytest.raises(Exception) as theirs:
            msg.metadata.sequence.stream  # noqa: B018
        assert type(ours.value) is type(theirs.value)
