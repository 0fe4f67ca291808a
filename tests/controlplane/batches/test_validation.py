"""An input file's lines, checked with no I/O."""

from __future__ import annotations

import pytest

from controlplane.batches.validation import TooManyLines, parse_input
from tests.controlplane.batches.conftest import jsonl, line


def parse(content: bytes, *, max_lines: int = 100) -> list:
    return parse_input(
        content,
        endpoint="/v1/chat/completions",
        allows_model=lambda model: model != "secret",
        max_lines=max_lines,
    )


def test_good_lines_keep_their_body_and_line_number() -> None:
    parsed = parse(jsonl(line("a", "x")) + b"\n\n" + jsonl(line("b", "y")))
    assert [(p.line_no, p.custom_id, p.error) for p in parsed] == [(1, "a", None), (4, "b", None)]
    assert parsed[0].body == line("a", "x")["body"]


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"\xff\xfe", "invalid_json", None),
        (b'"text"', "invalid_json", None),
        (jsonl({**line("a", "x"), "custom_id": 7}), "invalid_custom_id", "custom_id"),
        (jsonl(line("a" * 513, "x")), "invalid_custom_id", "custom_id"),
        (jsonl(line("a", "x", method="PUT")), "invalid_method", "method"),
        (jsonl(line("a", "x", url="/v1/completions")), "mismatched_url", "url"),
        (jsonl(line("a", "x", body=[])), "invalid_body", "body"),
        (jsonl(line("a", "x", model="secret")), "model_not_allowed", "body.model"),
        (
            jsonl(line("a", "x", body={"model": "m", "stream": True})),
            "invalid_stream",
            "body.stream",
        ),
    ],
)
def test_a_bad_line_is_named_with_its_field(raw: bytes, code: str, param: str | None) -> None:
    [parsed] = parse(raw)
    assert parsed.error is not None and parsed.body is None
    assert (parsed.error.code, parsed.error.param, parsed.error.line) == (code, param, 1)
    assert parsed.error.message.startswith("line 1")


def test_a_custom_id_used_twice_fails_the_second_line() -> None:
    first, second = parse(jsonl(line("a", "x"), line("a", "y")))
    assert first.error is None
    assert second.error is not None and second.error.code == "duplicate_custom_id"
    assert "line 2 (custom_id 'a')" in second.error.message


def test_more_lines_than_the_cap_is_refused_naming_the_limit() -> None:
    with pytest.raises(TooManyLines, match="3 requests; the limit is 2"):
        parse(jsonl(*(line(f"r{i}", "x") for i in range(3))), max_lines=2)
