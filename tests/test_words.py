"""Counts printed beside their nouns: singular for exactly 1, in the helper and in the lines that use it."""

from fastar.console import timings_line
from fastar.words import counted


def test_counted_says_one_in_the_singular_and_every_other_count_in_the_plural():
    assert [counted(n, "layer") for n in (0, 1, 2)] == ["0 layers", "1 layer", "2 layers"]
    assert counted(1, "reply", "replies") == "1 reply" and counted(3, "reply", "replies") == "3 replies"
    assert counted(1.0, "token") == "1.0 token" and counted(1.5, "token", fmt=".1f") == "1.5 tokens"
    assert counted(12345, "record", fmt=",") == "12,345 records"


def test_the_timings_line_of_a_one_token_run_says_token():
    """`fastar run -n 1` said "decode 1 tokens"; a one-token prompt "prompt 1 tokens"."""
    after = {"prompt_tokens": 1, "prefill_tokens_computed": 1, "prefill_seconds": 0.5}
    after |= {"generated_tokens": 2, "decode_tokens_computed": 1, "decode_seconds": 0.25}
    line = timings_line({}, after)
    assert "prompt 1 token (0 reused)" in line and "prefill 1 token in 0.50 s" in line
    assert "generated 2 tokens (the first by the prefill); decode 1 token in 0.25 s (4.0 tok/s)" in line, line
    assert "decode 2 tokens in" in timings_line({}, after | {"decode_tokens_computed": 2})
