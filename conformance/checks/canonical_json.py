"""canonical-json.json: §5.3 canonical JSON vectors and RFC 8785 Appendix B bit patterns."""

from __future__ import annotations

import struct
from typing import Any

from meshnode.protocol.canonical import canonical_text, parse_json

from .. import Recorder

FILES = ["canonical-json.json"]


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    for vector in fixture["vectors"]:
        with rec.case(f"vectors/{vector['name']}"):
            got = canonical_text(parse_json(vector["input_json"]))
            assert got == vector["canonical"], f"got {got!r}, want {vector['canonical']!r}"
    for row in fixture["number_bits"]:
        with rec.case(f"number_bits/{row['ieee754_hex']}"):
            value = struct.unpack(">d", bytes.fromhex(row["ieee754_hex"]))[0]
            got = canonical_text(value)
            assert got == row["canonical"], f"got {got!r}, want {row['canonical']!r}"
