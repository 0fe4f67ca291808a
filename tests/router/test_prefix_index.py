"""The prefix index (router/prefix_index.py): chunks of a prompt's text chained as an engine
chains its KV blocks, matched per replica, bounded, and forgetting replicas that leave."""

from __future__ import annotations

from typing import Any

import pytest

from router.prefix_index import (
    CHUNK_CHARS,
    MAX_PROMPT_CHUNKS,
    PrefixIndex,
    chunk_tokens,
    prompt_chunks,
)


def chat(*turns: str, system: str = "you are helpful " * 40) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, turn in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    return {"model": "m", "messages": messages}


def test_a_follow_up_turn_shares_the_chunks_of_the_turns_before() -> None:
    first = prompt_chunks(chat("what is a KV cache? " * 20))
    follow = prompt_chunks(chat("what is a KV cache? " * 20, "a cache of keys " * 30, "and?"))
    assert len(first) >= 3 and len(follow) > len(first)
    assert follow[: len(first) - 1] == first[: len(first) - 1]
    # Another system prompt breaks the chain from its first chunk on.
    other = prompt_chunks(chat("what is a KV cache? " * 20, system="be terse " * 80))
    assert other[0] != first[0] and not set(other) & set(first)


def test_prompts_of_text_of_token_ids_and_of_text_parts_are_chunked() -> None:
    text = "x" * (CHUNK_CHARS * 3 + 10)
    assert len(prompt_chunks({"prompt": text})) == 3  # a partial chunk has no hash
    assert len(prompt_chunks({"prompt": list(range(200))})) == 3  # 64 ids a chunk
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    assert prompt_chunks(parts) == prompt_chunks({"messages": [{"role": "user", "content": text}]})
    for nothing in ({"prompt": ["a", "b"]}, {"prompt": "short"}, {"messages": ["x"]}, {}):
        assert prompt_chunks(nothing) == ()
    assert chunk_tokens(4, {"prompt": "t"}) == 4 * CHUNK_CHARS // 4
    assert chunk_tokens(4, {"prompt": [1]}) == 256


def test_a_replica_matches_the_leading_chunks_it_was_sent() -> None:
    index = PrefixIndex()
    a = prompt_chunks(chat("alpha " * 100))
    b = prompt_chunks(chat("beta " * 100))
    index.record(a, 1)
    index.record(b, 2)
    index.record(a[:1], 3)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared == 2  # the system prompt's whole chunks
    assert index.match(a, [1, 2, 3]) == [len(a), shared, 1]
    assert index.match(b, [1, 2, 3]) == [shared, len(b), 1]
    assert index.match((), [1, 2]) == [0, 0]


def test_the_index_is_bounded_least_recently_used_first() -> None:
    index = PrefixIndex(capacity=8)
    old = prompt_chunks({"prompt": "o" * CHUNK_CHARS * 4})
    new = prompt_chunks({"prompt": "n" * CHUNK_CHARS * 4})
    index.record(old, 1)
    index.record(new, 2)
    assert len(index) == 8
    index.match(old, [1])  # a match refreshes the old prompt's chunks
    index.record(prompt_chunks({"prompt": "z" * CHUNK_CHARS * 4}), 3)
    assert len(index) == 8 and index.forgotten_total == 4
    assert index.match(old, [1]) == [4] and index.match(new, [2]) == [0]
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(capacity=0)


def test_a_replica_that_leaves_is_forgotten() -> None:
    index = PrefixIndex()
    chunks = prompt_chunks({"prompt": "q" * CHUNK_CHARS * 3})
    index.record(chunks, 1)
    index.record(chunks, 2)
    index.keep_only([2])
    assert index.match(chunks, [1, 2]) == [0, 3]
    index.keep_only([])
    assert len(index) == 0


def test_one_prompt_is_cut_into_a_bounded_number_of_chunks() -> None:
    huge = {"prompt": "h" * CHUNK_CHARS * (MAX_PROMPT_CHUNKS + 50)}
    assert len(prompt_chunks(huge)) == MAX_PROMPT_CHUNKS
