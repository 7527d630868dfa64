"""A parse (or signature check) of the commerce documents that repeat, once per distinct document.

Every meter event carries its SKU and the agreement that admitted it, and so
does every line of a node's usage log: the same few documents, record after
record. Parsing the SKU and verifying the agreement's signature were over half
of what rating an event cost (~200 of ~400 µs on the benchmarks' machine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import orjson

__all__ = ["ParsedOnce"]

_Parsed = TypeVar("_Parsed")


class ParsedOnce(Generic[_Parsed]):
    """``parse`` memoized on the exact content of its JSON document.

    The key is the document's JSON with sorted keys, so a hit returns what
    ``parse`` returned for the same content. A document that fails is never
    kept: it is parsed (and refused, and counted by the caller) every time. At
    most ``bound`` documents are kept, the least recently used evicted, so a
    stream of distinct documents costs what it did, never unbounded memory.
    What ``parse`` returns is shared between the hits: it must be immutable.
    """

    def __init__(self, parse: Callable[[object], _Parsed], bound: int = 256) -> None:
        self._parse = parse
        self._bound = max(1, bound)
        self._done: dict[bytes, _Parsed] = {}

    def __call__(self, document: object) -> _Parsed:
        try:
            key = orjson.dumps(document, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # not plain JSON (orjson refuses it): nothing to key on
            return self._parse(document)
        parsed = self._done.pop(key, None)
        if parsed is None:
            parsed = self._parse(document)  # raises for a bad document: not kept
            if len(self._done) >= self._bound:
                del self._done[next(iter(self._done))]
        self._done[key] = parsed  # (re)inserted last: the most recently used
        return parsed
