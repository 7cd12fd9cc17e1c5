"""The server batching requests over the real engine (tiny fixture, official numerics): concurrent requests get
exactly the tokens they get one at a time; a full queue is a 503 with Retry-After; a client that leaves frees its
slot; a restarted server with the same --prompt-cache folder prefills only the new tail of a resent prompt.

Prompts are token ids (`/v1/completions` accepts them), as the tiny model's vocabulary is 1,024 tokens.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from batch_helpers import needs_invariant_kernels  # noqa: E402 (after the importorskip)
from batch_helpers import prompt as random_prompt  # noqa: E402

from fastar.engine.engine import load  # noqa: E402 (after the importorskip)
from fastar.serve.server import Server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL = "deepseek-v4-flash"


def prompt(seed: int, n: int, first: int) -> list[int]:
    return [first, *random_prompt(seed, n)[1:]]  # distinct first tokens: no request reuses another's prefix


@pytest.fixture
def engine(tiny_ckpt):
    return load(tiny_ckpt)  # one per test: a server closes its engine when it shuts down


def start(engine, **kw) -> Server:
    kw.setdefault("port", 0)
    srv = Server(lambda: engine, **kw).start()
    assert srv.wait_ready(60)
    return srv


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)


def metric(srv: Server, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    m = re.search(rf"^fastar:{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def post(srv: Server, path: str, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.conn = conn  # type: ignore[attr-defined] - closed by the caller
    return resp


# (prompt length, request fields): greedy and seeded sampling, logprobs, stop strings, EOS honoured or not
REQUESTS = [
    (5, dict(max_tokens=30, temperature=0, extra_body={"ignore_eos": True})),
    (23, dict(max_tokens=24, temperature=0.8, seed=3, logprobs=3, extra_body={"ignore_eos": True})),
    (120, dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})),
    (9, dict(max_tokens=28, temperature=1.0, seed=9, top_p=0.9, extra_body={"ignore_eos": True, "top_k": 50})),
    (64, dict(max_tokens=12, temperature=0, logprobs=1)),
    (31, dict(max_tokens=30, temperature=0.7, seed=1)),
    (40, dict(max_tokens=26, temperature=0.6, seed=12, extra_body={"ignore_eos": True}, stop=["STOP"])),
]


def ask(cl: openai.OpenAI, ids: list[int], kw: dict) -> tuple:
    r = cl.completions.create(model=MODEL, prompt=ids, **kw)
    c = r.choices[0]
    lp = (c.logprobs.token_logprobs, c.logprobs.top_logprobs) if c.logprobs else None
    return c.text, c.finish_reason, lp, r.usage.completion_tokens


def test_concurrent_requests_equal_the_same_requests_one_at_a_time(engine):
    """Seven requests at once (different prompts, lengths, sampling, stops) give the text, logprobs and finish
    reasons they give one at a time; the batch-size histogram shows they really were decoded together."""
    needs_invariant_kernels()
    # No prefix reuse between the runs (max_sessions 0, no prompt cache): each prompt is prefilled afresh in both.
    srv = start(engine, max_batch=8, max_sessions=0)
    try:
        cl = client(srv)
        reqs = [(prompt(200 + i, n, first=10 + i), kw) for i, (n, kw) in enumerate(REQUESTS)]
        solo = [ask(cl, ids, kw) for ids, kw in reqs]
        # a stop string that does occur: cut the last request's solo text in the middle
        text = solo[-1][0]
        assert len(text) > 8
        reqs[-1][1]["stop"] = [text[len(text) // 2 : len(text) // 2 + 3]]
        solo[-1] = ask(cl, *reqs[-1])
        assert solo[-1][1] == "stop" and len(solo[-1][0]) < len(text)
        hist_before = metric(srv, 'batch_size_bucket{le="1"}')

        results: list = [None] * len(reqs)
        barrier = threading.Barrier(len(reqs))

        def run(i: int) -> None:
            barrier.wait()
            results[i] = ask(client(srv), *reqs[i])

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == solo
        calls = metric(srv, "batch_size_count")
        single = metric(srv, 'batch_size_bucket{le="1"}') - hist_before
        tokens = metric(srv, "batch_size_sum")
        assert calls > 0 and tokens / calls > 1 and single < sum(r[3] for r in solo)  # batched decode calls
    finally:
        srv.shutdown()


def test_n_best_of_and_prompt_lists_equal_solo_requests(engine):
    """`n`, `best_of` and a list of prompts on /v1/completions: each prompt prefilled once (usage and the engine's
    prefill counter count it once), choice j of a prompt equal to a request of its own with seed + j (greedy: all
    the same), best_of returning its highest cumulative logprob choice, a stream tagging each choice's deltas
    with its index."""
    needs_invariant_kernels()
    srv = start(engine, max_batch=8, max_sessions=0)  # no prefix reuse: every prompt prefilled afresh
    try:
        cl = client(srv)
        a, b = prompt(300, 40, first=20), prompt(301, 17, first=21)
        free = dict(max_tokens=12, extra_body={"ignore_eos": True})
        solo_greedy = ask(cl, a, dict(temperature=0, logprobs=1, **free))
        before, counted = engine.stats()["prefill_tokens_computed"], metric(srv, "prompt_tokens_total")
        r = cl.completions.create(model=MODEL, prompt=a, n=3, temperature=0, logprobs=1, **free)
        assert engine.stats()["prefill_tokens_computed"] - before == len(a)
        assert metric(srv, "prompt_tokens_total") - counted == len(a)  # /metrics counts the shared prompt once
        assert [c.index for c in r.choices] == [0, 1, 2]
        for c in r.choices:
            assert (c.text, c.finish_reason, (c.logprobs.token_logprobs, c.logprobs.top_logprobs)) == solo_greedy[:3]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(a), 36)

        seeded = dict(temperature=1.0, seed=11, **free)
        solo = {(i, j): ask(cl, p, {**seeded, "seed": 11 + j})[0] for i, p in enumerate((a, b)) for j in range(2)}
        assert solo[0, 0] != solo[0, 1]
        r = cl.completions.create(model=MODEL, prompt=[a, b], n=2, **seeded)
        assert [(c.index, c.text) for c in r.choices] == [(2 * i + j, solo[i, j]) for i in range(2) for j in range(2)]
        assert r.usage.prompt_tokens == len(a) + len(b) and r.usage.completion_tokens == 48
        before = engine.stats()["prefill_tokens_computed"]
        r = cl.completions.create(model=MODEL, prompt=[b, a, b], **seeded)  # a prompt given twice: one prefill
        assert engine.stats()["prefill_tokens_computed"] - before == len(a) + len(b)
        assert [c.text for c in r.choices] == [solo[1, 0], solo[0, 0], solo[1, 0]]
        assert r.usage.prompt_tokens == len(a) + len(b) and r.usage.completion_tokens == 36

        runs = [cl.completions.create(model=MODEL, prompt=b, **{**seeded, "seed": 11 + j}) for j in range(3)]
        scores = [
            sum(c.logprobs.token_logprobs)
            for c in (
                cl.completions.create(model=MODEL, prompt=b, logprobs=0, **{**seeded, "seed": 11 + j}).choices[0]
                for j in range(3)
            )
        ]
        best = max(range(3), key=lambda j: scores[j])
        r = cl.completions.create(model=MODEL, prompt=b, best_of=3, **seeded)
        assert [c.text for c in r.choices] == [runs[best].choices[0].text] and r.usage.completion_tokens == 36

        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for chunk in cl.completions.create(model=MODEL, prompt=[a, b], n=2, stream=True, **seeded):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        assert texts == {2 * i + j: solo[i, j] for i in range(2) for j in range(2)}
        assert finishes == dict.fromkeys(range(4), "length")
    finally:
        srv.shutdown()


def test_n_wider_than_max_batch_equals_solo_requests_with_bounded_forks(engine):
    """n=5 with --max-batch 2: the choices beyond two rows wait and fork from one kept copy of the prompt's state,
    so the scheduler never holds more than 3 forked states (2 rows + the copy); each choice equals a request of
    its own with seed + j, and the prompt is prefilled once."""
    needs_invariant_kernels()
    srv = start(engine, max_batch=2, max_sessions=0)
    try:
        cl = client(srv)
        a = prompt(310, 30, first=22)
        seeded = dict(max_tokens=8, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
        solo = [ask(cl, a, {**seeded, "seed": 5 + j})[0] for j in range(5)]
        before = engine.stats()["prefill_tokens_computed"]
        r = cl.completions.create(model=MODEL, prompt=a, n=5, **seeded)
        assert engine.stats()["prefill_tokens_computed"] - before == len(a)
        assert [c.text for c in r.choices] == solo and r.usage.completion_tokens == 40
        assert srv.host.batch_metrics()["forked_states_peak"] == 3
    finally:
        srv.shutdown()


def test_the_prefill_share_and_max_stall_reach_the_scheduler(engine):
    srv = start(engine, prefill_share=0.25, max_stall=0.125)
    try:
        assert srv.host.scheduler.prefill_share == 0.25 and srv.host.scheduler.max_stall == 0.125
    finally:
        srv.shutdown()


def test_full_queue_is_503_with_retry_after(engine):
    srv = start(engine, max_batch=1, max_queue=1)
    try:
        long = {"model": MODEL, "prompt": prompt(1, 8, 3), "max_tokens": 400, "ignore_eos": True, "stream": True}
        first = post(srv, "/v1/completions", long)  # admitted: the stream has begun
        assert first.status == 200 and first.readline().startswith(b"data:")
        second = post(srv, "/v1/completions", {**long, "prompt": prompt(2, 8, 4)})  # waits in the queue
        assert second.status == 200
        deadline = time.monotonic() + 10
        while srv.host.num_waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        third = post(srv, "/v1/completions", {**long, "stream": False})
        body = json.loads(third.read())
        assert third.status == 503 and int(third.getheader("Retry-After")) >= 1
        assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "unavailable_error"
        for r in (first, second, third):
            r.conn.close()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while srv.host.num_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.host.num_running() == 0
    finally:
        srv.shutdown()


def test_disconnect_frees_the_slot_within_a_step(engine):
    srv = start(engine, max_batch=1, max_queue=4)
    try:
        body = {"model": MODEL, "prompt": prompt(5, 12, 7), "max_tokens": 2000, "ignore_eos": True, "stream": True}
        resp = post(srv, "/v1/completions", body)
        assert resp.status == 200, resp.read()[:500]
        seen = []
        for _ in range(6):  # a stream of 2000 tokens: it cannot have ended yet
            seen.append(resp.readline())
            assert seen[-1], f"the stream ended after {seen[:-1]}"
        resp.conn.close()  # type: ignore[attr-defined] - the client leaves mid-stream
        at_close = engine.stats()["generated_tokens"]
        deadline = time.monotonic() + 10
        while srv.host.num_running() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert srv.host.num_running() == 0, "the request kept its slot after the client left"
        assert engine.stats()["generated_tokens"] - at_close < 50  # not the 2000 asked for
        assert metric(srv, "num_requests_running") == 0
        # the only slot is free again: the next request is served
        r = client(srv).completions.create(model=MODEL, prompt=prompt(6, 5, 8), max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        srv.shutdown()


def test_the_worker_hands_freed_heap_back_when_it_goes_idle(engine):
    """After requests are served and the worker has nothing to do, the server trims its heap (glibc kept the freed
    pages otherwise: RSS rose over hours of requests with a flat Python heap), once, not at every idle wake-up.
    (tests/test_heap.py: the trims while the worker stays busy.)"""
    srv = start(engine, max_batch=2)
    try:
        if not srv.heap.available:
            pytest.skip("no malloc_trim in this C library (not glibc): nothing to hand back with")
        assert metric(srv, "heap_trims_total") == 0  # nothing served yet
        cl = client(srv)
        for i in range(3):
            r = cl.completions.create(model=MODEL, prompt=prompt(20 + i, 9, 10 + i), max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
        # a trim declined as too soon after the last is taken at a later idle wake-up, within the interval
        time.sleep(srv.heap.idle_interval + 1)
        trims = metric(srv, "heap_trims_total")
        assert trims >= 1, "the worker went idle after serving requests and kept the freed heap"
        time.sleep(2 * srv.heap.idle_interval)  # idle: no more trims without more requests
        assert metric(srv, "heap_trims_total") == trims
    finally:
        srv.shutdown()


def test_restarted_server_prefills_only_the_tail_from_the_prompt_cache(engine, tiny_ckpt, tmp_path):
    folder = tmp_path / "pc"
    convo = prompt(7, 150, 9)
    srv = start(engine, prompt_cache=str(folder))
    try:
        r = client(srv).completions.create(model=MODEL, prompt=convo, max_tokens=6, temperature=0)
        assert r.usage.prompt_tokens_details is None or not r.usage.prompt_tokens_details.cached_tokens
        assert metric(srv, "prefix_cache_disk_bytes") > 0
    finally:
        srv.shutdown()
    assert any(folder.iterdir())

    engine = load(tiny_ckpt)
    srv = start(engine, prompt_cache=str(folder))  # a new server on the same folder
    try:
        resent = convo + prompt(8, 20, 11)
        before = metric(srv, "engine_prefill_tokens_computed")
        r = client(srv).completions.create(model=MODEL, prompt=resent, max_tokens=4, temperature=0)
        computed = metric(srv, "engine_prefill_tokens_computed") - before
        assert r.usage.prompt_tokens_details.cached_tokens == len(convo)
        assert computed == len(resent) - len(convo) == 20
        assert metric(srv, "prefix_cache_disk_hits_total") == 1
    finally:
        srv.shutdown()


def test_resent_conversation_reuses_the_state_kept_in_memory(engine):
    """Without a disk cache: a prompt that extends a finished request's prompt + reply starts from its state."""
    srv = start(engine, max_sessions=2)
    try:
        cl = client(srv)
        first = prompt(9, 40, 12)
        cl.completions.create(model=MODEL, prompt=first, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        before = metric(srv, "engine_prefill_tokens_computed")
        again = first + prompt(10, 10, 13)
        r = cl.completions.create(model=MODEL, prompt=again, max_tokens=3, temperature=0)
        computed = metric(srv, "engine_prefill_tokens_computed") - before
        assert r.usage.prompt_tokens_details.cached_tokens == len(first)
        assert computed == 10
        assert metric(srv, "prefix_cache_memory_hits_total") == 1
    finally:
        srv.shutdown()


def test_cached_prompt_shared_by_n_choices_counts_once_in_metrics(engine):
    """A prompt started from a kept state and shared by n choices: its cached tokens are counted once, in the
    response's usage and in /metrics' prompt_tokens_cached_total alike (as prompt_tokens_total counts it once)."""
    srv = start(engine, max_sessions=2)
    try:
        cl = client(srv)
        first = prompt(9, 40, 12)
        cl.completions.create(model=MODEL, prompt=first, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        cached_before = metric(srv, "prompt_tokens_cached_total")
        r = cl.completions.create(model=MODEL, prompt=first + prompt(10, 10, 13), n=3, max_tokens=3, temperature=0)
        assert len(r.choices) == 3 and r.usage.prompt_tokens_details.cached_tokens == len(first)
        assert metric(srv, "prompt_tokens_cached_total") - cached_before == len(first)
    finally:
        srv.shutdown()


def test_metrics_have_no_rate_before_there_is_one(engine):
    """/metrics on a fresh server said 0.000 for every rate (the last and average decode speed, the finished
    sequences' mean, the last step's seconds, the engine's prefill and decode tok/s, draft acceptance and tokens per
    pass): a measured standstill to a dashboard. After a one-token request (its token comes out of the prefill) the
    decode rates were still 0. A rate over nothing has no sample now (the gauge's HELP and TYPE stay, as for a
    labelled counter with no label yet); each appears once it is measured, and every sample is a finite number."""
    rates = (
        "generation_tokens_per_second",
        "avg_generation_tokens_per_second",
        "sequence_tokens_per_second_finished_mean",
        "engine_decode_tokens_per_s",
        "engine_draft_acceptance_rate",
        "engine_draft_tokens_per_pass",
    )

    def samples(srv) -> dict[str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        out = {}
        for line in text.splitlines():
            if not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.removeprefix("fastar:")] = float(value)
        assert all(v == v and abs(v) != float("inf") for v in out.values()), out
        assert "# TYPE fastar:generation_tokens_per_second gauge" in text  # declared, with no sample
        return out

    srv = start(engine)
    try:
        fresh = samples(srv)
        for name in (*rates, "step_seconds_last", "engine_prefill_tokens_per_s"):
            assert name not in fresh, name
        assert fresh["generation_tokens_total"] == 0
        cl = client(srv)
        one = dict(max_tokens=1, temperature=0, extra_body={"ignore_eos": True})
        assert cl.completions.create(model=MODEL, prompt=prompt(1, 8, 11), **one).usage.completion_tokens == 1
        after_one = samples(srv)
        assert after_one["generation_tokens_total"] == 1 and after_one["step_seconds_last"] > 0
        assert after_one["engine_prefill_tokens_per_s"] > 0
        for name in rates:  # one token, out of the prefill: no decode step, no decode speed
            assert name not in after_one, name
        three = dict(max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        assert cl.completions.create(model=MODEL, prompt=prompt(2, 8, 12), **three).usage.completion_tokens == 3
        decoded = samples(srv)
        for name in rates[:4]:
            assert decoded[name] > 0, name
        assert "engine_draft_acceptance_rate" not in decoded  # no draft: still nothing to rate
    finally:
        srv.shutdown()


def test_every_engine_rate_waits_for_its_counts(tiny_fst_path):
    """Every rate `engine.stats()` gives (a name ending in _per_s, _rate, _per_pass or GBps, as /metrics names it)
    is declared in `ENGINE_RATES` with the counts it divides by, so /metrics leaves it out until they are above 0:
    the expert cache's read_GBps and served_GBps were not, and said 0.0 on a fresh server. On a paged model: no
    rate before a request, the read rates once experts were read."""
    from fastar.serve.metrics import ENGINE_RATES, engine_gauges

    def names(stats: dict) -> set[str]:  # every number's name as /metrics flattens it, rates over nothing included
        return {f"{k}_{sub}" for k, v in stats.items() if isinstance(v, dict) for sub in v} | set(stats)

    def rates(keys) -> set[str]:
        return {k for k in keys if k.endswith(("_per_s", "_rate", "_per_pass", "GBps"))}

    eng = load(tiny_fst_path, ram_budget="1M")
    try:
        stats = eng.stats()
        assert "expert_cache_read_GBps" in names(stats)  # paged: the cache's stats are there
        assert rates(names(stats)) <= set(ENGINE_RATES)
        assert all(c in names(stats) for key in rates(names(stats)) for c in ENGINE_RATES[key])
        assert rates(engine_gauges(stats)) == set()
        eng.generate(random_prompt(3, 8), max_tokens=3, temperature=0)
        after = engine_gauges(eng.stats())
        assert {"expert_cache_read_GBps", "expert_cache_served_GBps", "decode_tokens_per_s"} <= rates(after)
        assert all(after[k] > 0 for k in rates(after) - {"expert_cache_hit_rate"})
    finally:
        eng.close()


def test_a_live_sequences_rate_counts_its_decoded_tokens():
    """The decode speed of an active sequence counted every generated token over the time since its first, which
    came out of the prefill: 3 tokens a second after the first said 3 tok/s for 2 decoded (a finished one's counts
    n - 1). Now both count the tokens after the first; a sequence with one token has no rate."""
    from types import SimpleNamespace

    from fastar.engine.batch_metrics import BatchMetrics

    now = time.perf_counter()
    seq = dict(pending=0, done=0, ids=[1], state=None, loading=None)
    active = [
        SimpleNamespace(generated=[5, 6, 7], first_token_at=now - 1.0, **seq),
        SimpleNamespace(generated=[5], first_token_at=now - 1.0, **seq),
    ]
    memory = type("Memory", (), {"hits": 0, "misses": 0, "__len__": lambda self: 0})()
    report = BatchMetrics().report(active, 0, memory, None, SimpleNamespace(forked_states=0, forked_states_peak=0))
    (rate,) = report["tokens_per_s_per_sequence"]
    assert 1.9 < rate <= 2.0, rate
    assert report["tokens_per_s_per_sequence_finished_mean"] is None and report["step_seconds_last"] is None
