"""A reply's DSML tool-call block, followed as it streams and settled at the end: the calls every API shape
reports, the same streamed or not, also when the block was cut off or is malformed.

`ToolBlock` feeds a `fastar.serve.toolstream.ToolCallStream` from a `fastar.encoding.StreamParser`'s tool-call
body (the `start` / `args` events the streams turn into `tool_use` blocks and `function_call` items) and gives
each call its id. `ToolBlock.settle()` decides, from the block parser's result, what the reply holds:

* The block parses (the model closed it): its calls, `tool_calls` as the finish reason. The authority is the
  block parser; the streamed ids are kept.
* It does not (cut off by max_tokens, the context or a stop string, or malformed): the calls the stream opened,
  one per `invoke` whose name was written. Each one whose closing tag was written is complete (its arguments are
  what the block parser gives for a call); a last one cut inside is *incomplete*: its `arguments` are the JSON
  text written so far (not closed: no client can take it for a whole call) and `cut_input` holds the parameters
  whose closing tag was written (what a partial JSON reader makes of that text: Anthropic's `input`). The finish
  reason is the cut's (or "stop"), never `tool_calls`. The block's raw text is not also given as content: the
  stream already described it as calls. A block in which no call was opened is dropped when the reply was cut
  (the markup of a call never written is nobody's text), and so is an opener cut short once it is past
  `\n\n<｜`; a malformed block the model ended itself comes back as the text it wrote (as the block parser
  releases it; nothing of it was streamed).

`ToolBlock.close()` then completes what was streamed to the settled calls (a start the stream missed, the
arguments' last characters) and closes each call, so a stream's events always add up to the reply's calls.

Does not own: the block grammar (`fastar.encoding`), the incremental parse (`fastar.serve.toolstream`), the API
shapes (`fastar.serve.anthropic`, `fastar.serve.responses`, `fastar.serve.choice_turn`). Pure Python.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastar.encoding import EOS, TOOL_CALLS_START, StreamParser
from fastar.serve.toolstream import ToolCallStream

log = logging.getLogger("fastar.serve")

# The start of the tool-call opener from which a cut-off tail is markup, not text: `<` then DSML's fullwidth bar
# (a reply may well end with a blank line and a `<`).
_OPENER_MARK = TOOL_CALLS_START[: TOOL_CALLS_START.index("｜") + 1]


@dataclass(slots=True)
class SettledBlock:
    """What a finished reply holds for its tool-call block (see the module docstring)."""

    content: str  # the reply's content, the block's raw text left out unless it stands for no call
    tool_calls: list[dict]  # OpenAI-shaped calls, complete ones first, an incomplete one last
    parsed: bool  # the block parsed as a whole: the calls are complete and the finish reason is `tool_calls`
    cut_input: dict | None = None  # the incomplete last call's completed parameters; None if there is none
    dropped: str = ""  # the block's raw text, left out of `content` (the parser had released it)

    @property
    def cut_call_id(self) -> str | None:
        """The id of the incomplete call, if the block was cut inside one."""
        return self.tool_calls[-1]["id"] if self.cut_input is not None else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolBlock:
    """The tool-call block of one reply, fed from its `StreamParser`."""

    def __init__(self) -> None:
        self.stream = ToolCallStream()
        self.ids: list[str] = []  # one per call the stream opened
        self._fed = 0  # characters of the parser's tool-call body fed to the stream

    def feed(self, parser: StreamParser) -> Iterator[tuple[str, Any]]:
        """`("tool_start", {"index", "id", "name"})` and `("tool_args", (index, json_piece))` for what the parser's
        tool-call body gained since the last call."""
        if not parser.in_tool_calls:
            return
        body = parser.tool_body[self._fed :].split(EOS, 1)[0]
        self._fed += len(body)
        for kind, index, value in self.stream.feed(body):
            if kind == "start":
                self.ids.append(new_call_id())
                yield "tool_start", {"index": index, "id": self.ids[index], "name": value}
            else:
                yield "tool_args", (index, value)

    def close(self, calls: list[dict]) -> Iterator[tuple[str, Any]]:
        """Per settled call (`SettledBlock.tool_calls`), what completes the streamed events to it, then
        `("tool_done", call)`: its `tool_start` if the stream never opened it, and the part of its arguments the
        stream had not yet given (a parsed block's closing characters, say) as one `tool_args`. Streamed pieces
        that disagree with the settled arguments cannot be taken back: that is logged."""
        for i, call in enumerate(calls):
            args = call["function"]["arguments"]
            if i >= len(self.ids):  # (the stream lost track; the block parser did not)
                yield "tool_start", {"index": i, "id": call["id"], "name": call["function"]["name"]}
                sent = ""
            else:
                sent = self.stream.arguments[i]
            if args.startswith(sent) and len(args) > len(sent):
                yield "tool_args", (i, args[len(sent) :])
            elif not args.startswith(sent):
                log.warning("streamed tool-call arguments %r disagree with the parsed block %r", sent, args)
            yield "tool_done", call

    def settle(
        self, content: str, parsed_calls: list[dict], released: list[tuple[str, str]], cut: bool
    ) -> SettledBlock:
        """The reply's block. `content` and `parsed_calls`: the parser's result (`finish()`); `released`: the events
        its `flush()` gave back (a block that did not parse, opener included, as content; or the text it held back
        as a possible marker); `cut`: the reply was cut (max_tokens, the context, a stop string) rather than ended
        by the model."""
        if parsed_calls:
            for i, call in enumerate(parsed_calls[: len(self.ids)]):
                call["id"] = self.ids[i]
            return SettledBlock(content, parsed_calls, True)
        text = "".join(t for kind, t in released if kind == "content")
        if not text or not content.endswith(text):
            return SettledBlock(content, [], False)
        if not text.startswith(TOOL_CALLS_START):  # held back as a possible opener: markup only past `\n\n<｜`
            if cut and len(text) >= len(_OPENER_MARK) and TOOL_CALLS_START.startswith(text):
                return SettledBlock(content[: len(content) - len(text)], [], False, None, text)
            return SettledBlock(content, [], False)
        if not self.ids and not cut:  # a malformed block the model ended: its text, as the parser released it
            return SettledBlock(content, [], False)
        stream = self.stream
        calls = [
            {
                "id": self.ids[i],
                "type": "function",
                "function": {"name": stream.names[i], "arguments": stream.arguments[i]},
            }
            for i in range(len(self.ids))
        ]
        cut_input = dict(stream.inputs[-1]) if calls and not stream.complete[-1] else None
        return SettledBlock(content[: len(content) - len(text)], calls, False, cut_input, text)
