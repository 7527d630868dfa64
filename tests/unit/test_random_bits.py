"""The batched OS randomness behind envelope ids and trace spans."""

from __future__ import annotations

import os
import re
import threading

import pytest

from meshnode.protocol import random_bits
from meshnode.protocol.random_bits import random_hex16, random_hex32, random_u64


def test_values_are_64_bit_and_formats_are_lowercase_hex() -> None:
    values = [random_u64() for _ in range(2000)]
    assert all(0 <= v < 2**64 for v in values)
    assert len(set(values)) == len(values)
    # 2,000 uniform 64-bit values: the top bit is set in about half of them.
    assert 800 < sum(v >> 63 for v in values) < 1200
    assert re.fullmatch(r"[0-9a-f]{16}", random_hex16())
    assert re.fullmatch(r"[0-9a-f]{32}", random_hex32())


def test_a_batch_running_out_reads_a_new_one() -> None:
    seen = {random_u64() for _ in range(3 * 256 + 7)}  # crosses several batch ends
    assert len(seen) == 3 * 256 + 7


def test_threads_never_receive_the_same_value() -> None:
    results: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def draw(out: list[int]) -> None:
        start.wait()
        out.extend(random_u64() for _ in range(5000))

    threads = [threading.Thread(target=draw, args=(out,)) for out in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [v for out in results for v in out]
    assert len(set(every)) == len(every) == 20_000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_reuse_the_parents_batch() -> None:
    random_bits._refill()  # the parent holds a fresh batch with 255 values left
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next values, then leave at once
        os.close(read_fd)
        os.write(write_fd, b"".join(random_u64().to_bytes(8, "big") for _ in range(8)))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    child = {int.from_bytes(data[i : i + 8], "big") for i in range(0, len(data), 8)}
    parent = {random_u64() for _ in range(8)}
    assert len(child) == 8
    assert not child & parent


def test_the_fork_hook_drops_the_batch() -> None:
    random_u64()
    random_bits._drop_batch_in_child()
    assert next(random_bits._values, None) is None
