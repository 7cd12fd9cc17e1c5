"""Prompt logprobs over HTTP on the real engine (a vocab-size random model): the exact bodies lm-evaluation-harness's
`local-completions` sends for loglikelihood and rolling loglikelihood (lm_eval/models/openai_completions.py:
`echo: true, max_tokens: 1, logprobs: 1, temperature: 0, seed: 1234` and the prompt as a batch of token-id lists),
read back the way the harness reads them, and vLLM's `prompt_logprobs` on completions and chat: every number equal to
`Engine.prompt_logprobs` on the same ids."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")

from test_server import raw  # noqa: E402 (after the importorskip)

from fastar.encoding import BOS, encode_messages  # noqa: E402
from fastar.engine.engine import load  # noqa: E402
from fastar.serve.server import Server  # noqa: E402

MODEL = "deepseek-v4-flash"


@pytest.fixture(scope="module")
def served(vocab_ckpt):
    """(server, its engine, a second engine on the same weights for the reference numbers)."""
    engines = []

    def factory():
        e = load(vocab_ckpt)
        e.context_length = 512
        engines.append(e)
        return e

    s = Server(factory, port=0).start()
    assert s.wait_ready(120)
    reference = load(vocab_ckpt)
    yield s, engines[0], reference
    s.shutdown()


def post(server, path: str, body: dict) -> dict:
    status, _, data = raw(server, "POST", path, body)
    assert status == 200, data
    return json.loads(data)


def harness_loglikelihood(response: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's `parse_logprobs` takes from one choice: the sum over the continuation (the
    prompt tokens from ctxlen on, the one generated token dropped) and whether each was the top-1."""
    lp = response["choices"][0]["logprobs"]
    tokens, tops = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
    return sum(tokens), all(tok == max(top.values()) for tok, top in zip(tokens, tops))


def harness_body(prompts: list[list[int]]) -> dict:
    """The body `local-completions` sends for loglikelihood: a batch of token-id lists, echoed and scored."""
    return {
        "model": MODEL,
        "prompt": prompts,  # the harness sends a batch: a list of token-id lists
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def test_harness_loglikelihood_body(served):
    s, _, ref = served
    tok = ref.tokenizer
    context, continuation = tok.encode("Question: what colour is the sky?\nAnswer:"), tok.encode(" blue")
    ids = context + continuation
    r = post(s, "/v1/completions", harness_body([ids]))
    want = ref.prompt_logprobs(ids, top=1)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1  # every prompt token, then the generated one
    assert lp["token_logprobs"][: len(ids)] == want.logprobs and lp["top_logprobs"][0] is None
    assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
    total, greedy = harness_loglikelihood(r, len(context))
    assert total == pytest.approx(sum(want.logprobs[len(context) :]), abs=1e-9) and total < 0
    assert greedy == all(rank == 1 for rank in want.ranks[len(context) :])
    assert r["choices"][0]["text"].startswith(tok.decode(ids)) and r["usage"]["completion_tokens"] == 1


def test_harness_batched_loglikelihood_body(served):
    """batch_size > 1: the harness sends several token-id lists in one `prompt` and reads choice i (by `index`) for
    request i, with its own context length."""
    s, _, ref = served
    tok = ref.tokenizer
    pairs = [("The sky is", " blue"), ("Two plus two is", " four"), ("A cat says", " meow")]
    batch = [(tok.encode(c), tok.encode(c + x)[len(tok.encode(c)) :]) for c, x in pairs]
    r = post(s, "/v1/completions", harness_body([c + x for c, x in batch]))
    choices = sorted(r["choices"], key=lambda c: c["index"])
    assert len(choices) == len(batch)
    for choice, (context, continuation) in zip(choices, batch):
        total, greedy = harness_loglikelihood({"choices": [choice]}, len(context))
        want = ref.prompt_logprobs(context + continuation)
        assert total == pytest.approx(sum(want.logprobs[len(context) :]), abs=1e-9)
        assert greedy == all(rank == 1 for rank in want.ranks[len(context) :])
        assert choice["logprobs"]["token_logprobs"][: len(want)] == want.logprobs


def test_harness_rolling_loglikelihood_body(served):
    """loglikelihood_rolling: the first window is [BOS] + the text's tokens, context length 1, so the text's
    log-likelihood is the sum of every logprob after the first."""
    s, _, ref = served
    bos = ref.tokenizer.token_to_id(BOS)
    ids = [bos] + ref.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    r = post(s, "/v1/completions", harness_body([ids]))
    total, _ = harness_loglikelihood(r, 1)
    want = ref.prompt_logprobs(ids)
    assert total == pytest.approx(want.total(), abs=1e-9)
    # perplexity from the same numbers: exp of the mean negative logprob
    nll = -torch.tensor(want.logprobs[1:], dtype=torch.float64)
    assert r["choices"][0]["logprobs"]["token_logprobs"][1:-1] == (-nll).tolist()


def test_echo_with_max_tokens_0_scores_the_prompt_only(served):
    s, _, ref = served
    text = "Paris is the capital of France."
    ids = ref.tokenizer.encode(text)
    r = post(s, "/v1/completions", {"model": MODEL, "prompt": text, "echo": True, "max_tokens": 0, "logprobs": 2})
    choice = r["choices"][0]
    want = ref.prompt_logprobs(ids, top=2)
    assert choice["text"] == text and choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"] == want.logprobs
    assert choice["logprobs"]["text_offset"][0] == 0 and len(choice["logprobs"]["tokens"]) == len(ids)
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(t) <= 2 for t in tops[1:])
    assert [max(t.values()) for t in tops[1:]] == [top[0][1] for top in want.top[1:]]
    # max_tokens 0 without echo would generate nothing and return nothing: a 400, as before
    status, _, data = raw(s, "POST", "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 0})
    assert status == 400 and json.loads(data)["error"]["param"] == "max_tokens"


def test_echo_logprobs_streamed(served):
    """Streamed: the echoed prompt comes in the first event with its logprobs, then the generated tokens'."""
    s, _, ref = served
    text = "One two three four"
    ids = ref.tokenizer.encode(text)
    cl = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
    events = list(
        cl.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=3, temperature=0, stream=True)
    )
    first = events[0].choices[0]
    assert first.text == text and first.logprobs.token_logprobs == ref.prompt_logprobs(ids).logprobs
    generated = [t for e in events[1:] if e.choices and e.choices[0].logprobs for t in e.choices[0].logprobs.tokens]
    assert len(generated) == 3


def test_vllm_prompt_logprobs_on_completions_and_chat(served):
    s, eng, ref = served
    text = "Tell me about the moon."
    ids = ref.tokenizer.encode(text)
    r = post(s, "/v1/completions", {"model": MODEL, "prompt": text, "prompt_logprobs": 3, "max_tokens": 2})
    want = ref.prompt_logprobs(ids, top=3)
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        entry = got[i]
        assert entry[str(ids[i])]["logprob"] == want.logprobs[i] and entry[str(ids[i])]["rank"] == want.ranks[i]
        assert entry[str(ids[i])]["decoded_token"] == ref.tokenizer.decode([ids[i]])
        assert {int(t): e["logprob"] for t, e in entry.items() if e["rank"] <= 3} | {ids[i]: want.logprobs[i]} == (
            dict(want.top[i]) | {ids[i]: want.logprobs[i]}
        )
    assert r["choices"][0]["logprobs"] is None  # no echo, no logprobs: the legacy object stays empty
    messages = [{"role": "user", "content": "Hi there"}]
    r = post(s, "/v1/chat/completions", {"model": MODEL, "messages": messages, "prompt_logprobs": 0, "max_tokens": 1})
    chat_ids = ref.tokenizer.encode(encode_messages(messages, thinking_mode="thinking"))
    want = ref.prompt_logprobs(chat_ids)
    got = r["prompt_logprobs"]  # top-level, as vLLM puts it on chat
    assert len(got) == len(chat_ids) and got[0] is None
    assert [next(iter(e.values()))["logprob"] for e in got[1:]] == want.logprobs[1:]
    for path, body in (
        ("/v1/completions", {"prompt": text, "prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"messages": messages, "prompt_logprobs": 1, "stream": True}),
        ("/v1/completions", {"prompt": text, "prompt_logprobs": 21}),
        ("/v1/completions", {"prompt": text, "prompt_logprobs": "all"}),
    ):
        status, _, data = raw(s, "POST", path, {"model": MODEL, **body})
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == "prompt_logprobs", data
    assert eng.stats()["requests"] >= 2
