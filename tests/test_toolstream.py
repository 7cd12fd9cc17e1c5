"""ToolCallStream against the block parser it streams ahead of (fastar.encoding.parse_tool_block): for any
well-formed DSML block cut into any pieces, the streamed names and argument pieces join to exactly what the
parser returns for the whole block; malformed blocks are flagged, never reported as done."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastar.encoding import DSML, TOOL_CALLS_START, parse_tool_block
from fastar.serve.toolstream import ToolCallStream

CLOSER = f"</{DSML}parameter>"
TEXT = st.lists(st.sampled_from(list('ab \n\t"\\<>/{}é中\x01') + [CLOSER[:5], f"</{DSML}"]), max_size=12).map("".join)
JSONISH = st.one_of(
    st.integers(-5, 5),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.sampled_from("xy"), st.integers(0, 9), max_size=2),
)


@st.composite
def blocks(draw):
    """A DSML block as the model may write it: any whitespace between elements, compact or spaced JSON,
    invalid JSON for a non-string value, string values with markup-like text."""
    ws = st.sampled_from(["", "\n", " \n", "\n\n"])
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        params = []
        for key in draw(st.lists(st.sampled_from(["a", "b", "x y", "é_2"]), unique=True, max_size=3)):
            kind = draw(st.sampled_from(["string", "json", "compact", "broken"]))
            if kind == "string":
                value, flag = draw(TEXT).replace(CLOSER, ""), "true"
            elif kind == "broken":
                value, flag = "{not json", "false"
            else:
                v = draw(JSONISH)
                value = json.dumps(v, separators=(",", ":") if kind == "compact" else None)
                flag = "false"
            params.append(f'<{DSML}parameter name="{key}" string="{flag}">{value}</{DSML}parameter>')
        inner = "".join(draw(ws) + p for p in params) + draw(ws)
        calls.append(f'<{DSML}invoke name="{draw(st.sampled_from(["f", "get_x"]))}">{inner}</{DSML}invoke>')
    return ">" + "".join(draw(ws) + c for c in calls) + draw(ws) + f"</{DSML}tool_calls>"


def feed_in_pieces(body: str, cuts: list[int]) -> tuple[ToolCallStream, list[tuple]]:
    stream, events = ToolCallStream(), []
    points = sorted({min(c, len(body)) for c in cuts}) + [len(body)]
    start = 0
    for p in points:
        events += stream.feed(body[start:p])
        start = p
    return stream, events


@settings(max_examples=300, deadline=None)
@given(blocks(), st.lists(st.integers(0, 400), max_size=30))
def test_streamed_calls_join_to_the_parsed_block(body, cuts):
    parsed = parse_tool_block(body)
    assert parsed is not None
    stream, events = feed_in_pieces(body, cuts)
    assert stream.done and not stream.broken
    assert stream.names == [c["function"]["name"] for c in parsed]
    assert stream.arguments == [c["function"]["arguments"] for c in parsed]
    starts = [e for e in events if e[0] == "start"]
    assert [e[1] for e in starts] == list(range(len(parsed)))
    for i in range(len(parsed)):
        assert "".join(e[2] for e in events if e[0] == "args" and e[1] == i) == stream.arguments[i]


@settings(max_examples=300, deadline=None)
@given(blocks(), st.integers(0, 400), st.lists(st.integers(0, 400), max_size=10))
def test_a_cut_block_says_which_calls_are_whole_and_what_parameters_it_completed(body, cut, cuts):
    """Cut anywhere: a call whose closing tag came is `complete` and its arguments parse to its `inputs`; the one cut
    inside has as `inputs` what a partial JSON reader (the anthropic SDK's, jiter's) makes of its arguments."""
    jiter = pytest.importorskip("jiter", reason="the partial JSON reader the anthropic client uses")
    whole = [json.loads(c["function"]["arguments"]) for c in parse_tool_block(body)]
    stream, _ = feed_in_pieces(body[:cut], cuts)
    assert len(stream.inputs) == len(stream.complete) == len(stream.arguments)
    for i, (args, inputs, complete) in enumerate(zip(stream.arguments, stream.inputs, stream.complete)):
        if complete:
            assert json.loads(args) == inputs == whole[i]
        else:
            assert i == len(stream.arguments) - 1  # only the last call can be open
            assert jiter.from_json(args.encode(), partial_mode=True) == inputs
            assert all(whole[i][k] == v for k, v in inputs.items())


def test_char_by_char_stream_holds_back_a_closing_tag():
    body = f'>\n<{DSML}invoke name="f">\n<{DSML}parameter name="s" string="true">a</{DSML}par'
    stream, events = feed_in_pieces(body, list(range(len(body))))
    pieces = "".join(e[2] for e in events if e[0] == "args")
    assert pieces == '{"s": "a'  # "</｜DSML｜par" is held: it may be the closing tag
    assert not stream.done


def test_malformed_blocks_are_flagged():
    repeated = (
        f'>\n<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">1</{DSML}parameter>'
        f'<{DSML}parameter name="a" string="true">2</{DSML}parameter></{DSML}invoke></{DSML}tool_calls>'
    )
    for body in (
        "oops",
        f'>\n<{DSML}invoke name="f">\n<{DSML}parameter name="q"k" string="true">1',
        f'>\n<{DSML}invok name="f">',
        f'>\n<{DSML}invoke name="f">\nplain text',
        repeated,
    ):
        stream = ToolCallStream()
        stream.feed(body)
        assert stream.broken and not stream.done, body
        assert parse_tool_block(body) is None, body
    assert TOOL_CALLS_START.endswith("tool_calls")


def test_a_value_nested_deeper_than_json_recurses_is_kept_as_text():
    """A model that writes a non-string value nested thousands deep ended the block parser (and so the reply) in a
    RecursionError; the value is kept as its text, as broken JSON is, and the stream streams the same arguments."""
    deep = "[" * 5000
    body = (
        f'>\n<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="false">{deep}</{DSML}parameter>\n'
        f"</{DSML}invoke>\n</{DSML}tool_calls>"
    )
    parsed = parse_tool_block(body)
    assert parsed is not None and json.loads(parsed[0]["function"]["arguments"]) == {"a": deep}
    stream, _ = feed_in_pieces(body, [10, 200, 3000])
    assert stream.done and stream.arguments == [parsed[0]["function"]["arguments"]]
