"""The expert cache's warm-up at start (`fastar.weights.warmup`, `Engine.warm_experts`): the budget's worth of experts
read in the background in file order or by the saved usage profile, never evicting; and over HTTP, `/health`
reporting it (loading with progress, then ready) while requests are already served."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import threading

import pytest

from fastar.convert.hf import convert
from fastar.engine.engine import load
from fastar.format.reader import FstFile
from fastar.weights import warmup
from fastar.weights.expert_cache import ExpertCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fst(tiny_ckpt, tmp_path_factory):
    return convert(tiny_ckpt, tmp_path_factory.mktemp("warm") / "t.fst", progress=False)


def test_warmup_fills_the_budget_in_file_order_without_evicting(fst):
    with FstFile(fst) as f, ExpertCache(f, f.expert_stride * 10) as cache:
        w = warmup.ExpertWarmup(cache)
        assert w.wait(60)
        st = w.status()
        assert st["status"] == "ready" and st["progress"] == 1.0 and st["source"] == "file order"
        assert st["experts_loaded"] == st["experts_target"] == 10
        assert cache.resident() == set(warmup.file_order(cache)[:10])
        assert cache.stats()["evictions"] == 0 and cache.free_slots() == 0


def test_warmup_stops_where_requests_took_the_slots(fst):
    """It never evicts: slots already holding what requests read stay, it fills only the free ones."""
    with FstFile(fst) as f, ExpertCache(f, f.expert_stride * 10) as cache:
        last = cache.num_layers - 1
        with cache.acquire(last, range(6)):  # a request's experts (not first in file order)
            pass
        w = warmup.ExpertWarmup(cache)
        assert w.wait(60) and w.status()["status"] == "ready"
        held = cache.resident()
        assert {(last, e) for e in range(6)} <= held and len(held) == 10
        assert cache.stats()["evictions"] == 0


def test_usage_profile_round_trip(fst, tmp_path):
    with FstFile(fst) as f, ExpertCache(f, f.expert_stride * 6) as cache:
        last = cache.num_layers - 1
        with cache.acquire(last, [5, 2, 7]):
            pass
        path = tmp_path / "p.json"
        assert warmup.save_profile(cache, path, "model-a") == 3
        order = warmup.load_profile(cache, path, "model-a")
        assert order[:3] == [(last, 2), (last, 5), (last, 7)]
        assert sorted(order) == sorted(warmup.file_order(cache))  # every expert once
        assert warmup.load_profile(cache, path, "model-b") is None  # another model's profile is not used
        assert warmup.load_profile(cache, tmp_path / "none.json", "model-a") is None
        path.write_text("{not json")
        assert warmup.load_profile(cache, path, "model-a") is None


def test_a_failed_profile_save_leaves_no_partial_file(fst, tmp_path):
    """A profile that cannot be written (here a folder stands where it goes) raises and leaves no temporary file."""
    with FstFile(fst) as f, ExpertCache(f, f.expert_stride * 6) as cache:
        (tmp_path / "p.json").mkdir()
        with pytest.raises(OSError):
            warmup.save_profile(cache, tmp_path / "p.json", "m")
        assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_a_failed_profile_save_at_close_says_one_line(fst, tmp_path, caplog):
    """`close` cannot save the profile: one warning line naming the profile and the reason (not the temporary name,
    which is gone), and nothing left in the folder."""
    engine = load(fst, ram_budget=str(FstFile(fst).expert_stride * 6), warm_experts=tmp_path)
    assert engine._warming.wait(60)
    profile = engine._warming.profile_path
    profile.mkdir()
    with caplog.at_level(logging.WARNING, logger="fastar.engine"):
        engine.close()
    assert [p.name for p in tmp_path.iterdir()] == [profile.name]
    [message] = [r.getMessage() for r in caplog.records if "usage profile" in r.getMessage()]
    assert "\n" not in message and str(profile) in message and ".partial" not in message


@pytest.mark.parametrize("experts", [5, "12", {"0": 1}, [[0, 1, 2], "x", None, [[0], 1]]])
def test_damaged_usage_profile_falls_back_to_file_order(fst, tmp_path, experts):
    """A profile of this model whose expert list is damaged (not a list, entries of another shape) is not an
    error: the server would not start over a file in its prompt cache folder. What cannot be read is left out."""
    with FstFile(fst) as f, ExpertCache(f, f.expert_stride * 6) as cache:
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"version": warmup.PROFILE_VERSION, "model": "m", "experts": experts}))
        order = warmup.load_profile(cache, path, "m")
        assert order is None or order == warmup.file_order(cache)
        path.write_text("[" * 100_000 + "]" * 100_000)  # nested past the JSON decoder's recursion limit
        assert warmup.load_profile(cache, path, "m") is None


def _get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def _complete(port: int) -> tuple[int, dict]:
    """A 3-token greedy completion of a fixed prompt: (status, reply)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "deepseek-v4-flash", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_server_serves_while_warming_and_health_reports_it(fst, tmp_path, monkeypatch):
    """`fastar serve`'s server over a paged engine: /health says the experts are loading (progress < 1) while a
    completion is answered, then ready; at shutdown the usage profile is saved beside the prompt cache and the
    next start warms from it."""
    from fastar.serve.server import Server

    gate, real = threading.Event(), ExpertCache.prefetch

    def held_prefetch(self, layer, ids, source="manual", **kw):  # the warm-up's reads wait for the gate
        if threading.current_thread().name == "fastar-expert-warmup":
            gate.wait(60)
        return real(self, layer, ids, source, **kw)

    monkeypatch.setattr(ExpertCache, "prefetch", held_prefetch)
    engines = []

    def factory():
        engines.append(load(fst, ram_budget=str(FstFile(fst).expert_stride * 12)))
        return engines[-1]

    cache_dir = tmp_path / "prompt-cache"
    srv = Server(factory, port=0, max_sessions=0, prompt_cache=str(cache_dir)).start()
    try:
        assert srv.wait_ready(60)
        status, body = _get(srv.port, "/health")
        assert status == 200 and body["status"] == "ok"
        exp = body["experts"]
        assert exp["status"] == "loading" and exp["progress"] < 1 and exp["experts_target"] == 12
        assert exp["source"] == "file order"
        status, reply = _complete(srv.port)
        assert status == 200 and reply["usage"]["completion_tokens"] == 3  # served while the warm-up waits
        assert _get(srv.port, "/health")[1]["experts"]["status"] == "loading"
        gate.set()
        assert engines[0]._warming.wait(60)
        status, body = _get(srv.port, "/health")
        assert status == 200 and body["experts"]["status"] == "ready" and body["experts"]["progress"] == 1.0
        held = engines[0].expert_cache.resident()
    finally:
        gate.set()
        srv.shutdown()
    saved = list(cache_dir.glob("hot-experts-*.json"))
    assert len(saved) == 1 and {tuple(k) for k in json.loads(saved[0].read_text())["experts"]} == held
    srv = Server(factory, port=0, max_sessions=0, prompt_cache=str(cache_dir)).start()
    try:
        assert srv.wait_ready(60)
        assert engines[1]._warming.wait(60)
        exp = _get(srv.port, "/health")[1]["experts"]
        assert exp["status"] == "ready" and exp["source"] == "profile"
        assert engines[1].expert_cache.resident() == held  # the same experts as when the last one stopped
    finally:
        srv.shutdown()


def _gated_warmup(monkeypatch) -> threading.Event:
    """Hold the warm-up's reads until the returned gate is set (requests' own reads are not held)."""
    gate, real = threading.Event(), ExpertCache.prefetch

    def held_prefetch(self, layer, ids, source="manual", **kw):
        if threading.current_thread().name == "fastar-expert-warmup":
            gate.wait(60)
        return real(self, layer, ids, source, **kw)

    monkeypatch.setattr(ExpertCache, "prefetch", held_prefetch)
    return gate


def _warmups() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("fastar-expert-warmup", "fastar-expert-io"))}


def test_load_warms_the_experts_while_the_resident_weights_load(fst, monkeypatch):
    """`load(warm_experts=True)` (what `serve` and `chat` ask for) starts the warm-up as soon as the cache exists:
    it is reading while the resident weights are still being checked, and fills the budget in file order."""
    import fastar.engine.engine as engine_module

    gate, seen = _gated_warmup(monkeypatch), []
    real_checked = engine_module.checked_reads

    @contextlib.contextmanager
    def checked(source):
        seen.append(any(t.name == "fastar-expert-warmup" for t in threading.enumerate()))
        with real_checked(source):
            yield

    monkeypatch.setattr(engine_module, "checked_reads", checked)
    engine = load(fst, ram_budget=str(FstFile(fst).expert_stride * 12), warm_experts=True)
    try:
        assert seen == [True]  # the warm-up was running when the resident weights were read and checked
        assert engine.warm_status()["status"] == "loading"
        gate.set()
        assert engine._warming.wait(60)
        st = engine.warm_status()
        assert st["status"] == "ready" and st["experts_loaded"] == 12 and st["source"] == "file order"
        assert engine.expert_cache.resident() == set(warmup.file_order(engine.expert_cache)[:12])
    finally:
        gate.set()
        engine.close()


def test_warming_at_load_changes_no_output_and_leaves_no_state(fst):
    """The warm-up only fills the cache: every token and logit is that of an engine without it, the engine's
    counters show no request, and there is no session or prompt state (the budget pages: reads and evictions)."""
    budget = str(FstFile(fst).expert_stride * 12)
    prompt = [5, 9, 2, 7, 11, 3]
    with load(fst, ram_budget=budget, warm_experts=True) as warm, load(fst, ram_budget=budget) as cold:
        assert warm._warming.wait(60) and warm.warm_status()["status"] == "ready"
        assert warm._session is None and warm.stats()["prompt_tokens"] == 0
        assert warm.generate_tokens(prompt, 6) == cold.generate_tokens(prompt, 6)
        assert (warm.logits(prompt) == cold.logits(prompt)).all()


def test_warming_at_load_follows_the_usage_profile(fst, tmp_path):
    """With the prompt cache's folder, the warm-up at load follows the profile the last engine saved at close, found
    under the name an engine warmed after its load saves it (`_fingerprint`, unchanged for this model)."""
    budget = str(FstFile(fst).expert_stride * 6)
    with load(fst, ram_budget=budget) as first:
        first.warm_experts(tmp_path)
        assert first._warming.wait(60)
        first.generate_tokens([9, 4, 7, 1], 3)  # evicts some of the file order's experts for its own
        held = first.expert_cache.resident()
        name = f"hot-experts-{first._fingerprint()[:16]}.json"
    assert [p.name for p in tmp_path.glob("hot-experts-*.json")] == [name]
    with load(fst, ram_budget=budget, warm_experts=tmp_path) as again:
        assert again._warming.wait(60)
        assert again.warm_status()["source"] == "profile" and again.expert_cache.resident() == held


def test_a_load_that_fails_stops_its_warm_up(tiny_fst_path, tmp_path):
    """A resident tensor failing its checksum fails the load as before, and the warm-up begun with it stops: no
    thread left reading, no usage profile written."""
    import shutil

    from fastar.errors import FormatError

    bad = tmp_path / "bad.fst"
    shutil.copyfile(tiny_fst_path, bad)
    with FstFile(tiny_fst_path) as f:
        head = next(t for t in f.header["tensors"] if t["name"] == "head.weight")
    with open(bad, "r+b") as fh:
        fh.seek(head["offset"] + 1000)
        fh.write(b"\x5a")
    before = _warmups()
    with pytest.raises(FormatError, match=r"head\.weight.*checksum"):
        load(bad, warm_experts=tmp_path / "cache")
    assert _warmups() <= before
    assert not list(tmp_path.glob("**/hot-experts-*.json"))


def test_a_request_during_the_warm_up_at_load_is_served(fst, tmp_path, monkeypatch):
    """A server over an engine warming since its load: /health answers 200 with the experts loading while the
    warm-up is held, and a completion sent then is answered with the tokens of an engine that never warmed."""
    from fastar.serve.server import Server

    budget = str(FstFile(fst).expert_stride * 12)
    with load(fst, ram_budget=budget) as cold:
        expected = cold.tokenizer.decode(cold.generate_tokens([5, 6, 7], 3))
    gate = _gated_warmup(monkeypatch)
    engines = []

    def factory():
        engines.append(load(fst, ram_budget=budget, warm_experts=tmp_path))
        return engines[-1]

    srv = Server(factory, port=0, max_sessions=0, prompt_cache=str(tmp_path)).start()
    try:
        assert srv.wait_ready(60)
        status, body = _get(srv.port, "/health")
        assert status == 200 and body["experts"]["status"] == "loading" and body["experts"]["progress"] < 1
        status, reply = _complete(srv.port)
        assert status == 200 and reply["usage"]["completion_tokens"] == 3
        assert reply["choices"][0]["text"] == expected  # served while the warm-up waits, with the same tokens
        gate.set()
        assert engines[0]._warming.wait(60)
        assert _get(srv.port, "/health")[1]["experts"]["status"] == "ready"
    finally:
        gate.set()
        srv.shutdown()
