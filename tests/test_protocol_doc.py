"""docs/protocol.md's message table is true: it has a row for every message in shared/messages.py
(and for KVTarget, which PrefillRequest carries), each row names every field of its class, and it
names no message or field the code does not have."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from shared import messages

PROTOCOL_MD = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
DOCUMENTED = {**messages.MESSAGE_TYPES, "KVTarget": messages.KVTarget}


def split_top_level(text: str) -> list[str]:
    """`a, b (x, y), c[d, e]` -> ['a', 'b (x, y)', 'c[d, e]']: commas inside brackets are the note's."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [part.strip() for part in [*parts, text[start:]] if part.strip()]


def message_table(markdown: str) -> dict[str, list[str]]:
    """The table under '## Messages': message name -> the field names its row lists, in order."""
    section = markdown.split("## Messages", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"{name} has two rows"
        fields = []
        for part in split_top_level(cells[1]):
            match = re.match(r"[a-z_][a-z0-9_]*", part)
            assert match, f"{name}: cannot read a field name from {part!r}"
            fields.append(match.group())
        rows[name] = fields
    return rows


TABLE = message_table(PROTOCOL_MD.read_text())


def test_the_table_has_a_row_for_every_message_and_none_for_what_does_not_exist() -> None:
    assert set(TABLE) == set(DOCUMENTED), (
        f"missing from docs/protocol.md: {sorted(set(DOCUMENTED) - set(TABLE))}; "
        f"not in shared/messages.py: {sorted(set(TABLE) - set(DOCUMENTED))}")


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_each_row_names_every_field_of_its_message_and_no_other(name: str) -> None:
    fields = [f.name for f in dataclasses.fields(DOCUMENTED[name])]
    documented = TABLE.get(name, [])
    assert sorted(documented) == sorted(fields), (
        f"{name}: missing from its row: {sorted(set(fields) - set(documented))}; "
        f"not a field: {sorted(set(documented) - set(fields))}")


def test_the_reader_sees_through_notes_in_a_field_list() -> None:
    fields = "request_id, pipeline (`p-md`/`p-rld-md`), targets: [`KVTarget`], kv_bytes{role}, note (a, b)"
    assert [re.match(r"[a-z_]+", p).group() for p in split_top_level(fields)] == [
        "request_id", "pipeline", "targets", "kv_bytes", "note"]
