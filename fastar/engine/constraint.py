"""Constrained decoding: JSON output and forced DSML tool calls, enforced token by token with llguidance.

Owns:
  * `output_grammar()`: what a request's reply must be, as an llguidance grammar (`Grammar`, Lark text): a JSON
    value valid against a schema (`response_format` / `text.format`), or the V4 chat template's DSML tool-call
    block with each function's parameters valid against its schema (`tool_choice` "required" / a named function,
    Anthropic "any" / "tool"), or either one (a schema with tools left to the model). Pure and cheap: it refuses
    what the DSML block cannot carry (`ConstraintError`); llguidance checks the schemas when the grammar compiles.
  * `GrammarCompiler`: one per engine. It builds the llguidance tokenizer from the engine's `tokenizer.json` once,
    compiles grammars under bounded parser limits (a schema llguidance does not support, or a grammar that needs
    more than the limits, is a `ConstraintError` naming it, never run for minutes) and keeps the last `CACHE_SIZE`
    compiled ones (an agent resends the same tools every turn). A server compiles before it queues the request.
  * `Constraint`: one request's parser state: `allowed()` is the mask of tokens that keep the reply inside the
    grammar, `advance(token)` moves past the sampled one. `fastar.engine.sampling.Sampler` applies it.

The DSML block is generated exactly as `fastar.encoding.render_tool_calls` writes it and as
`fastar.encoding.parse_tool_block` / `fastar.serve.toolstream` read it: `\\n\\n<｜DSML｜tool_calls>\\n`, then per call
`<｜DSML｜invoke name="NAME">\\n`, one `<｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>\\n`
per parameter (in the schema's `properties` order; the required ones always, the others when the model chooses;
no parameter the schema does not name), `</｜DSML｜invoke>\\n`, and `</｜DSML｜tool_calls>`, then EOS. A parameter
whose schema is a plain string (`type: string` with at most `minLength`, `maxLength`, `enum` or `const`) is written
as the template asks, `string="true"` and the raw text (which never contains `</｜DSML｜` or the EOS text, where
the parser would cut it); any other is `string="false"` and JSON valid against its schema.

Thinking mode: the reply starts with the reasoning, free text up to `</think>` (the special token; the reasoning
may not end the turn, nor spell `</think>`, the tool-call opener or EOS as text, which the stream parser would
take for the end of the reasoning), and the grammar applies from there on.

JSON is written compactly, with an optional space after `,` and `:` (as `json.dumps` writes it, which is how the
prompt shows the schemas) and no other whitespace between tokens: a grammar that allows unbounded whitespace lets
a model pad forever. The object's properties come in the schema's order (llguidance's rule).

Does not own: applying the mask to logits (`sampling.Sampler`), the API shapes that ask for a grammar
(`fastar.serve`). Imports no torch (the server builds grammars without it).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from ..encoding import DSML, EOS, THINK_END, TOOL_CALLS_END, TOOL_CALLS_START
from ..errors import FastarError

CACHE_SIZE = 32
MAX_GRAMMAR_BYTES = 1 << 20  # a grammar (the schemas in it) larger than this is refused before compiling
# llguidance's parser limits. Lexer fuel is spent at ~50k units/ms building a grammar's lexer and ~14k/ms per mask;
# a grammar over these limits is an error (a 400), not a stall of the worker that every other request waits on.
LIMITS = {
    "initial_lexer_fuel": 1_000_000,  # ~20 ms to build the lexer
    "step_lexer_fuel": 200_000,  # ~15 ms per token at most
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ?",
    "key_separator": ": ?",
    "coerce_one_of": False,  # oneOf only where llguidance proves its branches disjoint: never a value matching two
    "lenient": False,  # an unsupported keyword is an error, never silently unenforced
}
PLAIN_STRING_KEYS = {"type", "minLength", "maxLength", "enum", "const", "description", "title", "examples", "default"}
PARAMETERS_KEYS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "description",
    "title",
    "$defs",
    "definitions",
    "$schema",
    "$id",
    "$comment",
    "examples",
    "default",
    "strict",
}


_RX_META = set("\\.+*?()|[]{}^$#&-~/")


def _rx(text: str) -> str:
    """`text` as a literal inside an llguidance `/.../` regex."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _RX_META else c for c in text)


# Text the DSML parser cuts a value at: the closing tags and the EOS text.
_CUT_TEXTS = (f"</{DSML}", EOS)
_CUT = "|".join(map(_rx, _CUT_TEXTS))
# Reasoning ends at `</think>`; the stream parser also ends it at the tool-call opener and at EOS.
_REASONING_CUT = "|".join(map(_rx, (THINK_END, TOOL_CALLS_START, EOS)))


class ConstraintError(FastarError, ValueError):
    """A grammar that cannot be built or compiled (an unsupported schema, a tool choice naming no tool), or a
    constrained generation whose parser failed. `param` names the request field to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Grammar:
    """An llguidance grammar (Lark text) for a reply; `param`: the request field it came from (for errors)."""

    text: str
    param: str | None = None
    # (request field, `%json` rule) of each schema holding a `$ref`: one that only refers to itself compiles but
    # has no first token, so the compiler tries each alone before the request is queued
    probes: tuple[tuple[str | None, str], ...] = ()


# ---------------------------------------------------------------------------------------------------------
# Building grammars (pure)
# ---------------------------------------------------------------------------------------------------------


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_schema(schema: Any, defs: dict | None = None) -> str:
    """`%json {...}` for a schema, with this module's JSON options (the request's own `x-guidance` is dropped)."""
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema must be an object or true, got {json.dumps(schema)[:80]}")
    body = {k: v for k, v in schema.items() if k != "x-guidance"}
    for key, value in (defs or {}).items():
        body.setdefault(key, value)
    body["x-guidance"] = JSON_OPTIONS
    try:
        return "%json " + json.dumps(body, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise ConstraintError(f"the schema is not JSON: {err}") from None


def _plain_string(schema: Any) -> bool:
    """Whether a parameter's schema is a string the template's raw `string="true"` form can carry exactly."""
    if not isinstance(schema, dict) or schema.get("type") != "string" or set(schema) - PLAIN_STRING_KEYS:
        return False
    values = schema.get("enum", [])
    if not isinstance(values, list):  # malformed: the JSON form lets llguidance name the problem
        return False
    values = values + ([schema["const"]] if "const" in schema else [])
    return all(isinstance(v, str) and not any(c in v for c in _CUT_TEXTS) for v in values)


def _raw_string(name: str, schema: dict) -> str:
    """Lark terminal definitions for the raw value of a plain string parameter, closing tag included."""
    closing = _literal(f"</{DSML}parameter>")
    values = schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    for key in ("minLength", "maxLength"):  # checked first: the enum filter compares them (null is no bound either)
        bound = schema.get(key, 0)
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ConstraintError(f"parameter {name!r}: '{key}' must be a non-negative integer")
    if values is not None:
        values = [v for v in values if lo <= len(v) <= (hi if hi is not None else len(v))]
        if not values:
            raise ConstraintError(f"parameter {name!r}: no string satisfies its schema")
        return "(" + " | ".join(_literal(v) for v in values) + f") {closing}"
    count = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo},}}" if lo else "*"
    text = f"/(?s:.{count})/ & ~/(?s:.*)({_CUT})(?s:.*)/"
    return f"({text}) {closing}"


def _function_rules(index: int, fn: dict, probes: list[str]) -> list[str]:
    """Rules `f{index}`: one DSML invoke of `fn` (an OpenAI function object) with schema-valid parameters; the
    `%json` rules of parameters whose schema holds a `$ref` are added to `probes`."""
    name = fn.get("name")
    where = f"tool {name!r}"
    if not isinstance(name, str) or not name or '"' in name:
        raise ConstraintError(f"{where}: a tool name must be a non-empty string without '\"'")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ConstraintError(f"{where}: 'parameters' must be a JSON Schema object")
    extra = sorted(set(params) - PARAMETERS_KEYS)
    if extra or params.get("type", "object") != "object":
        what = f"{', '.join(extra)}" if extra else f"type {json.dumps(params.get('type'))}"
        raise ConstraintError(
            f"{where}: the parameters schema's top level may only list properties (an object), not {what}: "
            "each property becomes one DSML parameter"
        )
    props = params.get("properties") or {}
    required = params.get("required") or []
    additional = params.get("additionalProperties", True)
    if not isinstance(props, dict) or not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ConstraintError(f"{where}: 'properties' must be an object and 'required' a list of names")
    order = list(props) + [r for r in dict.fromkeys(required) if r not in props]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, parts = [], []
    for j, pname in enumerate(order):
        if '"' in pname:
            raise ConstraintError(f"{where}: parameter name {pname!r} cannot be written in a DSML tag")
        schema = props.get(pname, additional)
        if schema is False:
            raise ConstraintError(f"{where}: required parameter {pname!r} is not allowed by 'additionalProperties'")
        head = f'"<{DSML}parameter name=\\"{_literal(pname)[1:-1]}\\" string=\\"'
        rule = f"f{index}_p{j}"
        if _plain_string(schema):
            rules.append(f'{rule}: {head}true\\">" F{index}_P{j} "\\n"')
            rules.append(f"F{index}_P{j}: {_raw_string(pname, schema)}")
        else:
            rules.append(f'{rule}: {head}false\\">" {rule}_v "</{DSML}parameter>\\n"')
            rules.append(f"{rule}_v: {_json_schema(schema, defs)}")
            if "$ref" in rules[-1]:
                probes.append(rules[-1].split(": ", 1)[1])
        parts.append(rule if pname in required else f"{rule}?")
    opener = _literal(f'<{DSML}invoke name="{name}">\n')
    rules.insert(0, f"f{index}: {opener} {' '.join(parts)} {_literal(f'</{DSML}invoke>')}")
    return rules


def output_grammar(
    *,
    thinking: bool,
    functions: list[dict] | None = None,
    choice: str | None = None,
    parallel: bool = True,
    schema: dict | None = None,
    json_object: bool = False,
    schema_param: str = "response_format",
) -> Grammar | None:
    """The grammar a reply must follow, or None when nothing is enforced.

    Args:
        thinking: the reply starts with reasoning up to `</think>` (the grammar applies after it).
        functions: the request's tools as OpenAI function objects (`name`, `parameters`).
        choice: None / "auto" (the model decides), "required" (one or more calls of any of `functions`) or
            "function:NAME" (exactly one call of that function).
        parallel: with "required", several calls may follow each other (False: exactly one).
        schema: the reply's JSON schema (`response_format` json_schema); `json_object`: any JSON object.
            Enforced when no tool call is forced; with tools left to the model, the reply is this JSON or calls.
        schema_param: the request field to blame for the schema (`param` of the errors and of the `Grammar`).
    Raises:
        ConstraintError naming what is unsupported (the request field in `param`).
    """
    functions = functions or []
    force = choice not in (None, "auto", "none")
    wants_json = schema is not None or json_object
    if not force and not wants_json:
        return None
    names = [fn.get("name") for fn in functions]
    if force and not functions:
        raise ConstraintError(f"tool_choice {choice!r} forces a tool call, but the request has no tools", "tool_choice")
    if force and choice != "required":
        name = choice.removeprefix("function:")
        if name not in names:
            raise ConstraintError(
                f"tool_choice names the tool {name!r}, which is not among the request's tools "
                f"({', '.join(map(str, names))})",
                "tool_choice",
            )
        functions = [functions[names.index(name)]]
    rules: list[str] = []
    alternatives = []
    tool_probes: list[str] = []
    if force or functions:
        try:
            for i, fn in enumerate(functions):
                rules += _function_rules(i, fn, tool_probes)
        except ConstraintError as err:
            raise ConstraintError(str(err), "tools") from None
        invoke = " | ".join(f"f{i}" for i in range(len(functions)))
        more = ' (invoke "\\n")*' if parallel and (choice == "required" or not force) else ""
        rules.append(f"invoke: {invoke}")
        rules.append(f'calls: {_literal(TOOL_CALLS_START + ">")} "\\n" invoke "\\n"{more} {_literal(TOOL_CALLS_END)}')
        alternatives.append("calls")
    param = "tools" if force else schema_param  # what a compile error (a schema llguidance refuses) blames
    if wants_json and not force:
        try:
            rules.append(f"reply: {_json_schema(schema if schema is not None else {'type': 'object'})}")
        except ConstraintError as err:
            raise ConstraintError(f"{schema_param}: {err}", param) from None
        alternatives.insert(0, "reply")
    probes = [("tools", rule) for rule in tool_probes]
    if alternatives[0] == "reply" and "$ref" in rules[-1]:
        probes.append((schema_param, rules[-1].split(": ", 1)[1]))
    head = f"start: REASONING {THINK_END} answer" if thinking else "start: answer"
    reasoning = [f"REASONING: /(?s:.*)/ & ~/(?s:.*)({_REASONING_CUT})(?s:.*)/"] if thinking else []
    text = "\n".join(["%llguidance {}", head, *reasoning, f"answer: {' | '.join(alternatives)}", *rules]) + "\n"
    try:
        size = len(text.encode())
    except UnicodeEncodeError as err:  # a lone surrogate in a name or schema (the server refuses them earlier)
        raise ConstraintError(f"the schemas hold text that is not valid Unicode: {err}", param) from None
    if size > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"the schemas are too large to enforce ({size} bytes of grammar)", param)
    return Grammar(text, param, tuple(probes))


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


def _grammar_text(grammar: Grammar) -> str:
    return llguidance.LLMatcher.grammar_from_lark(grammar.text)


def _readable(message: str) -> str:
    """llguidance's message on one line, without the grammar excerpt it appends (our generated Lark, not the user's
    schema): the lines before the excerpt's numbered ones, less the lines of carets under a regex."""
    lines = []
    for line in message.strip().splitlines():
        if re.match(r"\s*\d+ \| ", line):
            break
        if line.strip() and set(line.strip()) != {"^"} and not re.fullmatch(r"<[\w-]+/>", line.strip()):
            lines.append(line.strip())
    return re.sub(r"^at \d+\(\d+\): ", "", " ".join(lines) or "unknown error")[:500]


# ---------------------------------------------------------------------------------------------------------
# Compiling against a tokenizer, and one request's parser
# ---------------------------------------------------------------------------------------------------------


class CompiledGrammar:
    """A grammar compiled for one tokenizer: `start()` gives each request its own parser (a copy of this one)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, param: str | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.param = param
        self._lock = threading.Lock()

    def start(self) -> Constraint:
        with self._lock:
            return Constraint(self._matcher.deep_copy(), self.vocab_size, self.param)


class GrammarCompiler:
    """One engine's grammars: the llguidance tokenizer (built on first use, ~1 s for the 129k vocabulary) and the
    last `CACHE_SIZE` compiled grammars. Thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int) -> None:
        self._json, self.vocab_size, self.eos_id = tokenizer_json, vocab_size, eos_id
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(self._json, n_vocab=self.vocab_size, eos_token=self.eos_id)
                except (ValueError, RuntimeError) as err:
                    raise ConstraintError(f"constrained decoding is unavailable for this tokenizer: {err}") from None
            return self._tokenizer

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(grammar.text)
            if hit is not None:
                self._cache.move_to_end(grammar.text)
                return hit
        # LLMatcher never raises for the grammar itself: an unsupported schema or a limit leaves it in error
        matcher = llguidance.LLMatcher(self.tokenizer, _grammar_text(grammar), log_level=0, limits=_limits())
        if matcher.is_error():
            raise ConstraintError(f"cannot enforce this: {_readable(matcher.get_error())}", grammar.param)
        for param, rule in grammar.probes:
            self._probe(param, rule)
        compiled = CompiledGrammar(matcher, self.vocab_size, grammar.param)
        with self._lock:
            self._cache[grammar.text] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _probe(self, param: str | None, rule: str) -> None:
        """Refuse a schema (`rule`: its `%json` rule) under which no value can start: one that only refers to
        itself, as `{"$ref": "#"}`, compiles, and llguidance fails at its first mask, mid-reply."""
        text = f"%llguidance {{}}\nstart: {rule}\n"
        matcher = llguidance.LLMatcher(self.tokenizer, _grammar_text(Grammar(text)), log_level=0, limits=_limits())
        try:
            if matcher.is_error():
                raise ConstraintError(_readable(matcher.get_error()))
            Constraint(matcher, self.vocab_size).allowed()
        except ConstraintError as err:
            raise ConstraintError(
                f"cannot enforce this: no JSON value can start under a schema (one that only refers to itself?): {err}",
                param,
            ) from None


class Constraint:
    """One request's position in its grammar. Used by one thread at a time (the sampler's). Its errors name
    `param`, the request field the grammar came from."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, param: str | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.param = param
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens that keep the output inside the grammar (only EOS once it is complete)."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            raise ConstraintError(f"the grammar's parser failed: {_readable(m.get_error())}", self.param)
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].view(bool)
        if not mask.any():
            raise ConstraintError("the grammar allows no token here", self.param)
        return mask

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise ConstraintError(
                f"token {token} is outside the grammar: {_readable(self._matcher.get_error())}", self.param
            )

    @property
    def finished(self) -> bool:
        """The grammar is complete and only EOS may follow."""
        return self._matcher.is_stopped()
