"""Constrained decoding (fastar.engine.constraint): JSON schemas and forced DSML tool calls.

The adversary is the vocab-size random model (real DeepSeek-V4 tokenizer, random weights): left free it never
writes JSON or a tool call (each test asserts so first), so every valid reply below is the grammar's doing. Over
HTTP the official `openai` and `anthropic` clients send the constrained request shapes of all three APIs; the
parsed tool calls and JSON replies are checked against their schemas with `jsonschema`.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a test dependency")

from test_server import accumulate_chat  # noqa: E402

from fastar.convert.hf import convert  # noqa: E402 (after the importorskip guards)
from fastar.encoding import DSML, THINK_END, encode_messages, parse_completion  # noqa: E402
from fastar.engine import constraint as C  # noqa: E402
from fastar.engine.engine import load  # noqa: E402
from fastar.engine.sampling import SamplingError, SamplingParams  # noqa: E402
from fastar.engine.tokenizer import Tokenizer  # noqa: E402
from fastar.errors import FastarError  # noqa: E402
from fastar.serve.server import Server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Bounded schemas: a random model writes strings and numbers until the grammar closes them, so a bound is what
# makes it finish within max_tokens (an unbounded string would be cut by max_tokens, grammar or not).
REPLY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["city", "n", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
SUM = {
    "name": "sum",
    "description": "Add numbers",
    "parameters": {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
        },
        "required": ["xs"],
    },
}
SCHEMAS = {fn["name"]: fn["parameters"] for fn in (WEATHER, SUM)}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
NO_THINK = {"thinking": {"type": "disabled"}}


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def check_calls(calls: list[dict], names: set[str]) -> None:
    """Each parsed call names one of `names` and its arguments validate against that tool's schema."""
    assert calls
    for call in calls:
        fn = call.get("function", call)
        assert fn["name"] in names
        args = fn["arguments"] if isinstance(fn["arguments"], dict) else json.loads(fn["arguments"])
        jsonschema.validate(args, SCHEMAS[fn["name"]])


@pytest.fixture(scope="module")
def fst(vocab_ckpt, tmp_path_factory):
    return convert(vocab_ckpt, tmp_path_factory.mktemp("constraint") / "m.fst", progress=False)


@pytest.fixture(scope="module")
def engine(fst):
    e = load(fst)
    e.context_length = 1024
    return e


def prompt(engine, messages=ASK, thinking=False, tools=None) -> list[int]:
    msgs = ([{"role": "system", "content": "", "tools": tools}] if tools else []) + messages
    return engine.tokenizer.encode(encode_messages(msgs, "thinking" if thinking else "chat"))


def run(engine, ids, grammar=None, **kw) -> tuple[str, list[int], str]:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 96), grammar=grammar, **kw)
    chunks = list(engine.stream(ids, params, session=engine.open_session()))
    return "".join(c.text for c in chunks), [c.token for c in chunks if c.token is not None], chunks[-1].finish_reason


# ---------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_reply_validates_where_the_free_reply_is_not_json(engine, temperature):
    ids = prompt(engine)
    free, _, _ = run(engine, ids, temperature=temperature, seed=3)
    assert not is_json(free)
    grammar = engine.compile_grammar(C.output_grammar(thinking=False, schema=REPLY))
    text, tokens, finish = run(engine, ids, grammar, temperature=temperature, seed=3)
    assert finish == "stop" and tokens[-1] == engine.tokenizer.eos_id  # the grammar closed, then EOS
    jsonschema.validate(json.loads(text), REPLY)


def test_banned_tokens_hold_under_a_grammar(engine):
    """`banned_token_ids` (the server's tool_choice "none" bans the DSML marker) hold under a grammar: a JSON reply
    with a token it wrote banned is another valid reply without it. Where the grammar allows only banned tokens (JSON
    or calls, the DSML marker banned, once the model wrote the block's opening newlines and "<") the request fails
    with a clear error, never a token outside the grammar."""
    ids = prompt(engine, tools=[WEATHER, SUM])
    grammar = engine.compile_grammar(C.output_grammar(thinking=False, schema=REPLY))
    _, free, _ = run(engine, ids, grammar, max_tokens=200)
    text, tokens, finish = run(engine, ids, grammar, max_tokens=200, banned_token_ids=[free[3]])
    assert finish == "stop" and free[3] not in tokens and tokens[:3] == free[:3]
    jsonschema.validate(json.loads(text), REPLY)
    either = engine.compile_grammar(C.output_grammar(thinking=False, functions=[WEATHER, SUM], schema=REPLY))
    dsml = engine.tokenizer.token_to_id(DSML)
    assert dsml in run(engine, ids, either, temperature=1.0, seed=0, max_tokens=200)[1]  # it writes calls
    with pytest.raises(SamplingError, match="the grammar allows only tokens this request bans"):
        run(engine, ids, either, temperature=1.0, seed=0, max_tokens=200, banned_token_ids=[dsml])


def test_ignore_eos_under_a_grammar_ends_at_the_completed_grammars_eos(engine):
    """`ignore_eos` with a grammar: once the grammar is complete it allows only EOS, so the request ends there
    ("stop", the reply of the same request without ignore_eos) instead of writing EOS until max_tokens."""
    ids = prompt(engine)
    grammar = engine.compile_grammar(C.output_grammar(thinking=False, schema=REPLY))
    plain = run(engine, ids, grammar, max_tokens=200)
    text, tokens, finish = run(engine, ids, grammar, max_tokens=200, ignore_eos=True)
    assert (text, tokens, finish) == plain and finish == "stop" and len(tokens) < 200
    assert tokens.count(engine.tokenizer.eos_id) == 1
    jsonschema.validate(json.loads(text), REPLY)


def test_json_object_reply_is_a_json_object_as_far_as_it_goes(engine):
    """`json_object` allows any object: the random model never closes its first key within max_tokens, so the
    reply is cut, but every character of it is JSON an object may start with."""
    ids = prompt(engine)
    free, _, _ = run(engine, ids, max_tokens=24)
    assert not free.startswith('{"')
    grammar = engine.compile_grammar(C.output_grammar(thinking=False, json_object=True))
    text, _, finish = run(engine, ids, grammar, max_tokens=24)
    assert finish == "length" and text.startswith('{"')
    json.loads(text + '":0}') if text.endswith('"') else json.loads('"' + text[2:] + '"')  # a valid key so far


@pytest.mark.parametrize(("choice", "names"), [("required", {"get_weather", "sum"}), ("function:sum", {"sum"})])
def test_forced_tool_call_parses_and_its_arguments_validate(engine, choice, names):
    ids = prompt(engine, tools=[WEATHER, SUM])
    free, _, _ = run(engine, ids)
    assert not parse_completion(free, thinking=False).tool_calls
    grammar = C.output_grammar(thinking=False, functions=[WEATHER, SUM], choice=choice, parallel=False)
    text, _, finish = run(engine, ids, engine.compile_grammar(grammar), max_tokens=200)
    parsed = parse_completion(text, thinking=False)
    assert finish == "stop" and parsed.content == "" and len(parsed.tool_calls) == 1
    check_calls(parsed.tool_calls, names)


def test_thinking_mode_reasons_then_the_grammar_holds_after_think_end(engine):
    """With thinking on, the grammar leaves the reasoning free and applies after `</think>`. The random model never
    closes its reasoning by itself; a thinking budget forces `</think>` (`fastar.engine.thinking_budget`), and the
    answer that follows is the schema's."""
    ids = prompt(engine, thinking=True)
    free, _, _ = run(engine, ids, max_tokens=48, thinking_budget=6)
    assert not is_json(parse_completion(free, thinking=True).content)
    grammar = engine.compile_grammar(C.output_grammar(thinking=True, schema=REPLY))
    text, tokens, finish = run(engine, ids, grammar, max_tokens=96, thinking_budget=6)
    parsed = parse_completion(text, thinking=True)
    assert finish == "stop" and len(tokens[: tokens.index(engine.tokenizer.token_to_id(THINK_END))]) == 6
    assert parsed.reasoning and not is_json(parsed.reasoning)
    jsonschema.validate(json.loads(parsed.content), REPLY)


def test_a_schema_with_tools_left_to_the_model_gives_that_json_or_valid_calls(engine):
    ids = prompt(engine, tools=[WEATHER, SUM])
    grammar = engine.compile_grammar(C.output_grammar(thinking=False, functions=[WEATHER, SUM], schema=REPLY))
    kinds = set()
    for seed in range(3):
        text, _, finish = run(engine, ids, grammar, temperature=1.0, seed=seed, max_tokens=200)
        parsed = parse_completion(text, thinking=False)
        assert finish == "stop"
        if parsed.tool_calls:
            check_calls(parsed.tool_calls, {"get_weather", "sum"})
            kinds.add("calls")
        else:
            jsonschema.validate(json.loads(parsed.content), REPLY)
            kinds.add("json")
    assert kinds  # (which of the two the random model picks is its business)


def test_a_constrained_and_a_free_request_share_steps_and_each_equals_its_solo_run(engine):
    ids = prompt(engine)
    grammar = engine.compile_grammar(C.output_grammar(thinking=False, schema=REPLY))
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=5, grammar=grammar)
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=5)
    solo = [run(engine, ids, **{"grammar": grammar, "temperature": 1.0, "seed": 5, "max_tokens": 40})[1]]
    solo.append(run(engine, ids, temperature=1.0, seed=5, max_tokens=40)[1])
    sched = engine.scheduler(max_batch=2)
    handles = [sched.submit(ids, constrained), sched.submit(ids, free)]
    sched.run_until_idle()
    batched = [[c.token for c in h if c.token is not None] for h in handles]
    assert batched == solo
    assert sched.metrics()["batch_size_histogram"].get(2, 0) > 0  # they decoded in the same model calls
    jsonschema.validate(json.loads(engine.tokenizer.decode(batched[0][:-1])), REPLY)


def test_a_constrained_request_does_not_draft_and_gets_the_plain_tokens(fst, engine):
    drafting = load(fst, draft="mtp")
    drafting.context_length = 1024
    ids = prompt(engine)
    grammar = C.output_grammar(thinking=False, schema=REPLY)
    sched = drafting.scheduler(max_batch=2)
    handle = sched.submit(ids, SamplingParams(max_tokens=40, grammar=drafting.compile_grammar(grammar)))
    sched.run_until_idle()
    assert sched.metrics()["draft_steps"] == 0
    assert [c.token for c in handle if c.token is not None] == run(engine, ids, engine.compile_grammar(grammar))[1]
    drafting.close()


class FailingGrammar(C.CompiledGrammar):
    """A compiled grammar whose parser fails at the third token (as one that ran out of its per-token fuel)."""

    def __init__(self, inner: C.CompiledGrammar) -> None:  # (no matcher of its own: `start` wraps the inner one's)
        self.inner = inner

    def start(self):
        real, calls = self.inner.start(), [0]

        class Failing:
            def allowed(self):
                calls[0] += 1
                if calls[0] == 3:
                    raise C.ConstraintError("the grammar's parser failed: out of fuel")
                return real.allowed()

            def advance(self, token):
                real.advance(token)

        return Failing()


def test_a_grammar_that_fails_mid_reply_ends_its_request_only(engine):
    ids = prompt(engine)
    grammar = FailingGrammar(engine.compile_grammar(C.output_grammar(thinking=False, schema=REPLY)))
    free = SamplingParams(max_tokens=12, temperature=0)
    sched = engine.scheduler(max_batch=2)
    failing, other = sched.submit(ids, SamplingParams(max_tokens=12, grammar=grammar)), sched.submit(ids, free)
    sched.run_until_idle()
    with pytest.raises(FastarError, match="out of fuel"):
        list(failing)
    assert [c.token for c in other if c.token is not None] == run(engine, ids, max_tokens=12)[1]


# ---------------------------------------------------------------------------------------------------------
# The grammar itself (the real tokenizer, no model)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer.default()
    return tok, C.GrammarCompiler(tok.hf.to_str(), tok.vocab_size, tok.eos_id)


def test_thinking_mode_reasons_freely_until_think_end_then_the_grammar_holds(compiler):
    tok, comp = compiler
    c = comp.compile(C.output_grammar(thinking=True, schema=REPLY)).start()
    end = tok.token_to_id(THINK_END)
    allowed = c.allowed()
    assert allowed[end] and not allowed[tok.eos_id]  # the reasoning may not end the turn
    assert allowed[tok.encode("Hmm")[0]] and allowed[tok.encode(" {")[0]]
    for t in tok.encode("Let me think: Paris, mild."):
        c.advance(t)
    for t in tok.encode("</think"):  # `</think>` spelled as plain text would end the reasoning for the parser
        c.advance(t)
    close = tok.encode(">")[0]
    assert not c.allowed()[close]
    with pytest.raises(C.ConstraintError):
        c.advance(close)
    c = comp.compile(C.output_grammar(thinking=True, schema=REPLY)).start()
    c.advance(end)
    allowed = np.nonzero(c.allowed())[0]
    assert {tok.decode([int(t)]) for t in allowed} <= {"{", '{"', '{"c', '{"ci', '{"city', '{"city"'}


def test_raw_string_parameters_cannot_carry_the_closing_tag(compiler):
    """A plain string parameter is written raw (`string="true"`); the text `</｜DSML｜` inside it would end it for
    the parser, so the grammar never lets it in."""
    tok, comp = compiler
    grammar = C.output_grammar(thinking=False, functions=[WEATHER], choice="function:get_weather")
    c = comp.compile(grammar).start()
    head = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">a'
    )
    for t in tok.encode(head):
        c.advance(t)
    for t in tok.encode("</"):
        c.advance(t)
    dsml = tok.token_to_id("｜DSML｜")
    assert c.allowed()[dsml]  # the closing tag itself: the value ends here
    rest = '｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    for t in tok.encode(rest + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"):
        c.advance(t)
    assert c.finished and np.nonzero(c.allowed())[0].tolist() == [tok.eos_id]


DEEP: dict = {"type": "string"}
for _ in range(200):
    DEEP = {"type": "array", "items": DEEP}


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"schema": {"type": "string", "format": "nonsense"}}, "response_format", "Unknown format: nonsense"),
        ({"schema": {"type": "object", "if": {}, "then": {}}}, "response_format", "Unimplemented keys"),
        ({"schema": {"type": "strin"}}, "response_format", "strin"),
        # a regex error is several lines; only its first ("regex parse error:") came through, naming nothing
        ({"schema": {"type": "string", "pattern": "(a"}}, "response_format", "regex parse error: (a error: unclosed"),
        ({"schema": {"type": "string", "pattern": "[z-a]"}}, "response_format", "start must be <= the end"),
        ({"schema": DEEP}, "response_format", "recursion limit"),
        ({"schema": {"enum": ["a\ud800"]}}, "response_format", "not valid Unicode"),
        ({"schema": {"enum": [f"value number {i}" for i in range(80_000)]}}, "response_format", "too large"),
        ({"functions": [WEATHER], "choice": "function:nope"}, "tool_choice", "'nope', which is not among"),
        (
            {"functions": [{"name": "f", "parameters": {"properties": {"a": {"format": "bogus", "type": "string"}}}}]}
            | {"choice": "required"},
            "tools",
            "Unknown format: bogus",
        ),
        (
            {"functions": [{"name": "f", "parameters": {"properties": {"a": {"enum": "x", "type": "string"}}}}]}
            | {"choice": "required"},
            "tools",
            "enum must be an array",
        ),
        ({"functions": [], "choice": "required"}, "tool_choice", "has no tools"),
        ({"functions": [{"name": "f", "parameters": {"anyOf": []}}], "choice": "required"}, "tools", "anyOf"),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(compiler, kwargs, param, words):
    with pytest.raises(C.ConstraintError) as err:  # building refuses what DSML cannot carry, compiling the rest
        compiler[1].compile(C.output_grammar(thinking=False, **kwargs))
    assert err.value.param == param and words in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# Over HTTP, with the official clients
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(fst):
    def factory():
        e = load(fst)
        e.context_length = 1024
        return e

    s = Server(factory, port=0).start()
    assert s.wait_ready(120)
    yield s
    s.shutdown()


def _openai(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)


def _anthropic(s) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)


def test_chat_completions_response_format_and_tool_choice(server, caplog):
    cl = _openai(server)
    kw = {"model": "deepseek-v4-flash", "messages": ASK, "temperature": 0, "extra_body": NO_THINK}
    free = cl.chat.completions.create(max_tokens=40, **kw).choices[0].message
    assert not is_json(free.content) and not free.tool_calls
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY, "strict": True}}
    reply = cl.chat.completions.create(max_tokens=60, response_format=fmt, **kw).choices[0]
    assert reply.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), REPLY)
    sampled = {**kw, "temperature": 1.0, "seed": 4}
    choices = cl.chat.completions.create(max_tokens=60, response_format=fmt, n=2, **sampled).choices
    assert len(choices) == 2 and choices[0].message.content != choices[1].message.content
    for choice in choices:  # each choice is constrained on its own
        jsonschema.validate(json.loads(choice.message.content), REPLY)
    obj = cl.chat.completions.create(max_tokens=12, response_format={"type": "json_object"}, **kw)
    assert obj.choices[0].message.content.startswith('{"')

    tools = [{"type": "function", "function": fn} for fn in (WEATHER, SUM)]
    for choice, names in (
        ("required", {"get_weather", "sum"}),
        ({"type": "function", "function": {"name": "sum"}}, {"sum"}),
    ):
        out = cl.chat.completions.create(
            max_tokens=200, tools=tools, tool_choice=choice, parallel_tool_calls=False, **kw
        ).choices[0]
        assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) == 1
        check_calls([c.model_dump() for c in out.message.tool_calls], names)
    # the grammar's block streams piece by piece, and the pieces are what the block parser makes of it
    with caplog.at_level(logging.WARNING, logger="fastar.serve"):
        chunks = cl.chat.completions.create(max_tokens=200, tools=tools, tool_choice="required", stream=True, **kw)
        streamed, pieces = accumulate_chat(chunks)
    assert streamed.choices[0].finish_reason == "tool_calls" and pieces
    check_calls([c.model_dump() for c in streamed.choices[0].message.tool_calls], {"get_weather", "sum"})
    assert all(len(parts) > 2 for parts in pieces.values()) and "disagree" not in caplog.text


def test_responses_text_format_and_tool_choice(server):
    cl = _openai(server)
    kw = {"model": "deepseek-v4-flash", "input": ASK[0]["content"], "temperature": 0, "reasoning": {"effort": "none"}}
    fmt = {"format": {"type": "json_schema", "name": "reply", "schema": REPLY, "strict": True}}
    r = cl.responses.create(max_output_tokens=60, text=fmt, **kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), REPLY)
    tools = [{"type": "function", **fn} for fn in (WEATHER, SUM)]
    r = cl.responses.create(
        max_output_tokens=200, tools=tools, tool_choice={"type": "function", "name": "get_weather"}, **kw
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1
    check_calls([{"name": c.name, "arguments": c.arguments} for c in calls], {"get_weather"})


def test_anthropic_tool_choice_any_and_tool(server):
    cl = _anthropic(server)
    tools = [
        {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
        for fn in (WEATHER, SUM)
    ]
    kw = {
        "model": "x",
        "max_tokens": 200,
        "messages": ASK,
        "tools": tools,
        **NO_THINK,
        "extra_body": {"temperature": 0},
    }
    free = cl.messages.create(**{**kw, "max_tokens": 40})
    assert free.stop_reason == "max_tokens" and all(b.type == "text" for b in free.content)
    for choice, names in (
        ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "sum"}),
        ({"type": "tool", "name": "get_weather"}, {"get_weather"}),
    ):
        msg = cl.messages.create(tool_choice=choice, **kw)
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) == 1
        check_calls([{"name": u.name, "arguments": u.input} for u in uses], names)
    with cl.messages.stream(tool_choice={"type": "tool", "name": "get_weather"}, **kw) as stream:
        pieces = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert json.loads("".join(pieces)) == use.input  # the input_json_delta pieces add up to the parsed input
    check_calls([{"name": use.name, "arguments": use.input}], {"get_weather"})


def test_anthropic_output_config_format(server):
    cl = _anthropic(server)
    kw = {"model": "x", "max_tokens": 60, "messages": ASK, **NO_THINK, "extra_body": {"temperature": 0}}
    free = cl.messages.create(**kw)
    assert not is_json(free.content[0].text)
    msg = cl.messages.create(output_config={"format": {"type": "json_schema", "schema": REPLY}}, **kw)
    assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"]
    jsonschema.validate(json.loads(msg.content[0].text), REPLY)
    with pytest.raises(anthropic.BadRequestError) as err:  # a schema the grammar cannot enforce
        cl.messages.create(output_config={"format": {"type": "json_schema", "schema": {"type": "strin"}}}, **kw)
    assert "strin" in err.value.message


def test_an_absent_tool_or_an_unenforceable_schema_is_a_400_on_all_three_apis(server):
    oa, an = _openai(server), _anthropic(server)
    base = {"model": "deepseek-v4-flash", "max_tokens": 4}
    tools = [{"type": "function", "function": WEATHER}]
    named = {"type": "function", "function": {"name": "nope"}}
    cases = [
        lambda: oa.chat.completions.create(messages=ASK, tools=tools, tool_choice=named, **base),
        lambda: oa.chat.completions.create(messages=ASK, tool_choice="required", **base),
        lambda: oa.chat.completions.create(
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "strin"}}},
            **base,
        ),
        lambda: oa.responses.create(
            model="deepseek-v4-flash",
            input="x",
            tools=[{"type": "function", **WEATHER}],
            tool_choice={"type": "function", "name": "nope"},
        ),
        lambda: oa.responses.create(
            model="deepseek-v4-flash", input="x", tool_choice={"type": "function", "name": "get_weather"}
        ),
        lambda: oa.responses.create(
            model="deepseek-v4-flash",
            input="x",
            text={"format": {"type": "json_schema", "name": "r", "schema": {"format": "nonsense", "type": "string"}}},
        ),
    ]
    params = ["tool_choice", "tool_choice", "response_format", "tool_choice", "tool_choice", "text.format"]
    for case, param in zip(cases, params):
        with pytest.raises(openai.BadRequestError) as err:
            case()
        assert err.value.body["param"] == param
    BOGUS = {"type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}}
    an_tools = [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]
    for body, words in (
        ({"tools": an_tools, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not among"),
        ({"tool_choice": {"type": "any"}}, "has no tools"),
        ({"tools": [{"name": "f", "input_schema": BOGUS}], "tool_choice": {"type": "any"}}, "Unknown format: bogus"),
    ):
        with pytest.raises(anthropic.BadRequestError) as err:
            an.messages.create(model="x", max_tokens=4, messages=ASK, **body)
        assert words in err.value.message


@pytest.mark.parametrize(
    "prop",
    [
        {"type": "string", "enum": ["a"], "minLength": "1"},  # bounds of another type beside an enum
        {"type": "string", "enum": ["a"], "maxLength": "9"},
        {"type": "string", "enum": ["a"], "minLength": True},
        {"type": "string", "enum": ["a"], "minLength": None},
        {"type": "string", "maxLength": None},
    ],
)
def test_malformed_length_bounds_beside_an_enum_are_a_400(server, prop):
    """A forced call's string parameter with an enum and length bounds that are not integers: a 400 blaming
    `tools`, as without the enum (they reached a TypeError while the grammar was built: a 500)."""
    fn = {"name": "pick", "parameters": {"type": "object", "properties": {"a": prop}, "required": ["a"]}}
    with pytest.raises(openai.BadRequestError) as err:
        _openai(server).chat.completions.create(
            model="deepseek-v4-flash",
            messages=ASK,
            max_tokens=4,
            tools=[{"type": "function", "function": fn}],
            tool_choice="required",
        )
    assert err.value.body["param"] == "tools"


SELF_REF = {"$ref": "#"}  # refers only to itself: no JSON value can start (llguidance fails at the first mask)


@pytest.mark.parametrize("thinking", [False, True])
def test_a_schema_that_only_refers_to_itself_is_a_400_naming_its_field_on_every_api(server, thinking):
    """Such a schema compiles, and the reply's first JSON token found no mask: a 400 with no `param` (or, after
    the reasoning, a 500 mid-reply). It is refused before the request is queued, naming the field."""
    oa, an = _openai(server), _anthropic(server)
    mode = {} if thinking else NO_THINK
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SELF_REF}}
    props = {"type": "object", "properties": {"a": SELF_REF}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": props}}]
    weather = [{"type": "function", "function": WEATHER}]
    kw = {"model": "deepseek-v4-flash", "messages": ASK, "max_tokens": 40, "extra_body": mode}
    cases = [
        (lambda: oa.chat.completions.create(response_format=fmt, **kw), "response_format"),
        (lambda: oa.chat.completions.create(response_format=fmt, stream=True, **kw), "response_format"),
        (lambda: oa.chat.completions.create(tools=tools, tool_choice="required", **kw), "tools"),
        (lambda: oa.chat.completions.create(tools=weather, response_format=fmt, **kw), "response_format"),
        (
            lambda: oa.responses.create(
                model="deepseek-v4-flash",
                input="x",
                text={"format": {"type": "json_schema", "name": "r", "schema": SELF_REF}},
                reasoning={"effort": "medium" if thinking else "none"},
            ),
            "text.format",
        ),
    ]
    for case, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            case()
        assert err.value.body["param"] == param
        assert "refers to itself" in err.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        an.messages.create(
            model="x",
            max_tokens=40,
            messages=ASK,
            output_config={"format": {"type": "json_schema", "schema": SELF_REF}},
            **({} if thinking else NO_THINK),
        )
    assert "refers to itself" in err.value.message
    ok = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer"}}}
    reply = oa.chat.completions.create(  # a $ref that resolves is enforced as before
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": ok}}, **kw
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
