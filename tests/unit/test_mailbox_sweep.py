"""The registry's mailbox sweep reads one page of the stream listing per tick (issue #21):
the cursor's paging, pass by pass."""

from __future__ import annotations

from meshnode.transport.streams import STREAM_LIST_PAGE, SweepCursor


def _offsets(cursor: SweepCursor, pages: list[int]) -> list[int]:
    """The offset each successive page is asked from, for pages listing ``pages`` streams."""
    asked = []
    for listed in pages:
        asked.append(cursor.offset)
        cursor.advance(listed)
    return asked


def test_a_listing_of_many_pages_is_read_a_page_per_tick_then_starts_over() -> None:
    # 10,000 mailboxes: 39 full pages and one of 16, then the next pass from 0.
    cursor = SweepCursor()
    full, last = divmod(10_000, STREAM_LIST_PAGE)
    pages = [STREAM_LIST_PAGE] * full + [last]
    asked = _offsets(cursor, pages)
    assert asked == [i * STREAM_LIST_PAGE for i in range(full + 1)]
    assert (cursor.offset, cursor.passes) == (0, 1)
    assert _offsets(cursor, [STREAM_LIST_PAGE, 3]) == [0, STREAM_LIST_PAGE]
    assert cursor.passes == 2


def test_a_listing_of_one_short_page_is_a_whole_pass_every_tick() -> None:
    # A small mesh: every tick is a complete pass, as before the sweep was paged.
    cursor = SweepCursor()
    assert _offsets(cursor, [12, 12, 12]) == [0, 0, 0]
    assert cursor.passes == 3


def test_an_empty_page_ends_the_pass() -> None:
    # The listing shrank under the cursor (streams deleted): the page past the
    # end is empty, and the next tick starts over rather than asking past it again.
    cursor = SweepCursor(page_size=4)
    assert _offsets(cursor, [4, 4, 0, 4]) == [0, 4, 8, 0]
    assert (cursor.offset, cursor.passes) == (4, 1)


def test_an_exact_multiple_of_the_page_size_needs_the_empty_page_to_end() -> None:
    # A full last page cannot be told from a middle one: one more (empty) page ends the pass.
    cursor = SweepCursor(page_size=2)
    assert _offsets(cursor, [2, 2, 0]) == [0, 2, 4]
    assert cursor.passes == 1
