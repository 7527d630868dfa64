"""The transport error taxonomy: nats-py's exceptions as the errors callers catch."""

from __future__ import annotations

from typing import Any, cast

import nats.errors
import nats.js.errors
import pytest

from meshnode.transport.errors import (
    Conflict,
    NoResponders,
    NotConnected,
    NotFound,
    Reconnecting,
    StoreFull,
    TransportError,
    TransportTimeout,
    Unavailable,
    translate,
    translated,
)
from meshnode.transport.jetstream import PullConsumer, StreamReader
from tests.fakes import FakePullSubscription


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (nats.js.errors.NotFoundError(code=404, err_code=10059, description="stream not found"), NotFound),
        (nats.js.errors.KeyNotFoundError(), NotFound),  # built without APIError's fields
        (nats.js.errors.KeyDeletedError(), NotFound),
        (nats.js.errors.KeyWrongLastSequenceError(description="wrong last sequence: 3"), Conflict),
        (nats.js.errors.BadRequestError(code=400, err_code=10058, description="in use"), Conflict),
        (nats.js.errors.APIError(code=500, err_code=10047, description="insufficient resources"), StoreFull),
        (nats.js.errors.ServiceUnavailableError(code=503), Unavailable),
        (nats.errors.TimeoutError(), TransportTimeout),
        (nats.errors.NoRespondersError(), NoResponders),
        (nats.js.errors.NoStreamResponseError(), NoResponders),
        (nats.errors.ConnectionReconnectingError(), Reconnecting),
        (nats.errors.ConnectionClosedError(), NotConnected),
        (nats.js.errors.APIError(code=400, err_code=1, description="odd"), TransportError),
    ],
)
def test_each_nats_error_maps_to_its_transport_error(raised: Exception, expected: type[TransportError]) -> None:
    error = translate(raised)
    assert type(error) is expected


def test_a_translated_timeout_is_still_a_timeout_error() -> None:
    with pytest.raises(TimeoutError), translated():
        raise nats.errors.TimeoutError


def test_api_codes_and_cause_are_kept() -> None:
    raised = nats.js.errors.NotFoundError(code=404, err_code=10037, description="no message found")
    with pytest.raises(NotFound) as caught, translated():
        raise raised
    assert (caught.value.code, caught.value.err_code, str(caught.value)) == (404, 10037, "no message found")
    assert caught.value.__cause__ is raised


async def test_other_exceptions_and_cancellation_pass_through_unchanged() -> None:
    """Only nats-py's errors are translated: the block's own errors, and a
    cancellation across an await inside it, propagate as they are."""
    import asyncio

    with pytest.raises(KeyError), translated():
        raise KeyError("mine")

    inside = asyncio.Event()

    async def waits() -> None:
        with translated():
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(waits())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("timeout", [nats.errors.TimeoutError(), TimeoutError()], ids=["nats", "asyncio"])
async def test_a_fetch_that_times_out_either_way_brings_no_messages(timeout: Exception) -> None:
    """nats-py's fetch ends in its own TimeoutError on some paths and in
    asyncio's, untranslated, on another (a deadline spent before its lingering
    request). Both are no messages: a service's fetch loop logged the second
    as a failed fetch and paused."""
    psub = FakePullSubscription(raises=timeout)
    assert await PullConsumer(cast(Any, psub)).fetch(16, timeout=1.0) == []
    reader = StreamReader(cast(Any, None), "S", "reader", cast(Any, psub))
    assert await reader.fetch(16, timeout=1.0) == []
    assert psub.fetches == [(16, 1.0), (16, 1.0)]
