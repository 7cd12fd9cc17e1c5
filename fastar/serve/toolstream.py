"""DSML tool calls parsed as they stream, so a client sees each call's name and argument JSON while the model
writes them (Anthropic's `input_json_delta`, Responses' `function_call_arguments.delta`).

Owns `ToolCallStream`: fed the text after the tool-call opener (`\\n\\n<｜DSML｜tool_calls`), it returns
`("start", index, name)` and `("args", index, json_text)` events. The argument pieces of a call concatenate to
exactly the `arguments` string `fastar.encoding.parse_tool_block` gives for the finished block
(`json.dumps(args, ensure_ascii=False)`): string parameters are escaped piece by piece (JSON escapes one
character at a time, so the pieces join to the whole), other values are held until their closing tag and
then normalised as the block parser does. Text that could still be the start of a closing tag is held back.

The block parser stays the authority for a block that parses. When the block turns out malformed or cut off,
`broken` is set (or the stream simply stops short); what was streamed is then described by `names`,
`arguments` (the JSON text so far), `inputs` (the parameters whose closing tag was written, as values) and
`complete` (whether each call's closing tag was written): `fastar.serve.cut_calls` reports the calls from them.
Does not own: the block grammar (`fastar.encoding`), the API events (`fastar.serve.anthropic`,
`fastar.serve.responses`). Pure Python.
"""

from __future__ import annotations

import json
import re

from fastar.encoding import DSML, TOOL_CALLS_END, json_value

_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>')
_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')
_PARAM_END = f"</{DSML}parameter>"
_INVOKE_END = f"</{DSML}invoke>"
_WS = re.compile(r"\s*")


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class ToolCallStream:
    """Incremental DSML tool-call block parser (see the module docstring)."""

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0
        self._state = "open"  # open -> calls -> params -> value -> params ... -> done | broken
        self._index = -1
        self._params: set[str] = set()
        self._string = True
        self._param, self._value_at = "", 0  # the open parameter, and where its value starts in the buffer
        self.names: list[str] = []
        self.arguments: list[str] = []
        self.inputs: list[dict] = []  # per call: its parameters whose closing tag was written
        self.complete: list[bool] = []  # per call: its closing tag was written

    @property
    def broken(self) -> bool:
        return self._state == "broken"

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        events: list[tuple] = []
        while self._state not in ("done", "broken") and self._step(events):
            pass
        return events

    def _emit(self, events: list[tuple], piece: str) -> None:
        if piece:
            self.arguments[self._index] += piece
            events.append(("args", self._index, piece))

    def _skip_ws(self) -> None:
        self._pos = _WS.match(self._buf, self._pos).end()

    def _tag(self, pattern: re.Pattern, head: str, closer: str) -> re.Match | bool | None:
        """A complete opening tag at the cursor; None while it (or `closer`) may still come; False if neither can."""
        rest = self._buf[self._pos :]
        m = pattern.match(self._buf, self._pos)
        if m is not None:
            return m
        if closer.startswith(rest) or head.startswith(rest) or (rest.startswith(head) and ">" not in rest):
            return None
        return False

    def _step(self, events: list[tuple]) -> bool:
        """One transition; False when more text is needed."""
        buf = self._buf
        if self._state == "open":
            if not buf:
                return False
            if buf[0] != ">":
                self._state = "broken"
                return False
            self._pos, self._state = 1, "calls"
            return True
        if self._state in ("calls", "params"):  # never inside a value: its whitespace is part of it
            self._skip_ws()
        rest = buf[self._pos :]
        if self._state == "calls":
            if rest.startswith(TOOL_CALLS_END):
                self._state = "done"
                return False
            m = self._tag(_INVOKE, f"<{DSML}invoke", TOOL_CALLS_END)
            if m is None:
                return False
            if m is False:
                self._state = "broken"
                return False
            self._index += 1
            self.names.append(m.group(1))
            self.arguments.append("")
            self.inputs.append({})
            self.complete.append(False)
            self._params = set()
            events.append(("start", self._index, m.group(1)))
            self._emit(events, "{")
            self._pos, self._state = m.end(), "params"
            return True
        if self._state == "params":
            if rest.startswith(_INVOKE_END):
                self._emit(events, "}")
                self.complete[self._index] = True
                self._pos, self._state = self._pos + len(_INVOKE_END), "calls"
                return True
            m = self._tag(_PARAM, f"<{DSML}parameter", _INVOKE_END)
            if m is None:
                return False
            if m is False or m.group(1) in self._params:  # the block parser refuses a repeated parameter
                self._state = "broken"
                return False
            name, self._string = m.group(1), m.group(2) == "true"
            self._param, self._value_at = name, m.end()
            self._emit(
                events,
                ("" if not self._params else ", ")
                + json.dumps(name, ensure_ascii=False)
                + ": "
                + ('"' if self._string else ""),
            )
            self._params.add(name)
            self._pos, self._state = m.end(), "value"
            return True
        # value: runs to the closing parameter tag
        end = buf.find(_PARAM_END, self._pos)
        if end < 0:
            if self._string:
                keep = next(
                    (k for k in range(min(len(rest), len(_PARAM_END) - 1), 0, -1) if _PARAM_END.startswith(rest[-k:])),
                    0,
                )
                self._emit(events, _escaped(rest[: len(rest) - keep]))
                self._pos += len(rest) - keep
            return False
        value = buf[self._pos : end]
        if self._string:
            self._emit(events, _escaped(value) + '"')
            self.inputs[self._index][self._param] = buf[self._value_at : end]
        else:
            try:
                parsed = json_value(value)
            except ValueError:
                parsed = value  # as the block parser keeps it
            self._emit(events, json.dumps(parsed, ensure_ascii=False))
            self.inputs[self._index][self._param] = parsed
        self._pos, self._state = end + len(_PARAM_END), "params"
        return True
