"""An input file's lines, checked with no I/O."""

from __future__ import annotations

import json

import pytest

from controlplane.batches import validation
from controlplane.batches.validation import MAX_NESTING, TooManyLines, parse_input, split_lines
from tests.controlplane.batches.conftest import jsonl, line


def parse(content: bytes, *, max_lines: int = 100) -> list:
    return parse_input(
        split_lines([content]),
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


def test_lines_are_read_across_the_chunks_they_straddle() -> None:
    content = jsonl(line("a", "x"), line("b", "y")) + b"\r\n" + json.dumps(line("c", "z")).encode()
    cuts = [content[i : i + 7] for i in range(0, len(content), 7)]
    assert (
        list(split_lines(cuts))
        == list(split_lines([content]))
        == [*content.split(b"\n")[:2], b"", json.dumps(line("c", "z")).encode()]
    )
    assert [
        (p.line_no, p.custom_id)
        for p in parse_input(
            split_lines(cuts), endpoint="/v1/chat/completions", allows_model=bool, max_lines=9
        )
    ] == [(1, "a"), (2, "b"), (4, "c")]


def test_a_line_nested_5000_deep_fails_alone_naming_its_line() -> None:
    deep = b'{"custom_id": "d", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    first, second, third = parse(jsonl(line("a", "x"), deep, line("b", "y")))
    assert first.error is None and third.error is None
    assert second.error is not None and second.error.code == "too_deeply_nested"
    assert second.error.message.startswith("line 2: nests arrays and objects over 100 levels")


def test_a_line_under_the_recursion_limit_but_over_the_nesting_cap_fails_too() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    nested: object = "x"
    for _ in range(MAX_NESTING):
        nested = [nested]
    [parsed] = parse(jsonl(line("a", "x", body={**body, "extra": nested})))
    assert parsed.error is not None and parsed.error.code == "too_deeply_nested"
    assert "line 1 (custom_id 'a')" in parsed.error.message


def test_an_unexpected_error_on_a_line_fails_that_line_only(monkeypatch) -> None:
    real = validation._check_request

    def check(data, endpoint, allows_model):  # type: ignore[no-untyped-def]
        if data["custom_id"] == "boom":
            raise KeyError("surprise")
        return real(data, endpoint, allows_model)

    monkeypatch.setattr(validation, "_check_request", check)
    good, bad = parse(jsonl(line("a", "x"), line("boom", "y")))
    assert good.error is None
    assert bad.error is not None and bad.error.code == "unreadable_line"
    assert bad.error.message == "line 2 (custom_id 'boom'): could not be checked (KeyError)"
