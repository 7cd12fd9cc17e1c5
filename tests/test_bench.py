"""`fastar bench -m FILE --json`: the end-to-end benchmark runs and reports what the closing notes quote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastar.bench.model import COLD_PROBES
from fastar.convert.hf import convert
from fastar.engine.engine import open_source
from fastar.format.reader import FstFile


def _bench(*args: str) -> subprocess.CompletedProcess:
    """`fastar bench ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "fastar", "bench", *args], capture_output=True, text=True, timeout=600)


def test_bench_json(tiny_ckpt, tmp_path):
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    png = tmp_path / "curve.png"
    r = _bench(
        "-m",
        str(fst),
        "--json",
        "--ram-budget",
        "400K,auto",
        "--prompt-tokens",
        "6",
        "--decode-tokens",
        "3",
        "--policies",
        "lrfu,lru",
        "--plot",
        str(png),
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for k in ("decode_tok_s", "ceiling_tok_s", "hit_rate", "peak_rss_bytes", "ram_budget_bytes", "resident_bytes"):
        assert k in out
    small, small_lru, auto, auto_lru = out["runs"]
    assert [x["cache_policy"] for x in out["runs"]] == ["lrfu", "lru", "lrfu", "lru"]
    assert 0 < small["ram_budget_bytes"] <= 400 * 1024 < auto["ram_budget_bytes"]
    assert not small["preloaded"] and auto["preloaded"] and auto["hit_rate"] == 1.0  # every expert in RAM, warm
    assert auto["hit_rate"] >= small["hit_rate"] and auto["bytes_read_per_token"] == 0
    assert small["bytes_read_per_token"] > 0 and out["decode_tok_s"] > 0 and out["ceiling_tok_s"] > 0
    assert small["state_positions"] == 6 + 8 + 3 and small["state_bytes"] == small["state_bytes_accounted"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # prefill against its I/O ceiling where it read experts: compute from the all-in-RAM run of the same prompt
    with FstFile(fst) as f:
        stride = f.expert_stride
    assert small["prefill_reads"] > 0 and small["prefill_bytes_read"] == small["prefill_reads"] * stride
    own = small["prefill_s"] - small["prefill_stall_s"]
    assert small["prefill_compute_s"] == min(auto["prefill_s"], auto_lru["prefill_s"], own)
    # the disk's rate: the fastest cold probe, or the rate the prefill's reads were served at where faster
    served = small["prefill_bytes_read"] / small["prefill_read_busy_s"] / 1e9
    assert small["prefill_disk_gbps"] == pytest.approx(max(out["disk_gbps"], served))
    assert out["disk_gbps"] == max(v for k, v in out["disk"].items() if k in COLD_PROBES)
    io = small["prefill_bytes_read"] / (small["prefill_disk_gbps"] * 1e9)
    assert small["prefill_io_ceiling_tok_s"] == pytest.approx(6 / max(io, small["prefill_compute_s"]))
    assert small["prefill_fraction_of_io_ceiling"] > 0 and "prefill_io_ceiling_tok_s" not in auto
    # decode: the larger of the memory and the disk times, the disk's at the faster of the probe and the served rate
    for x in (small, small_lru):
        assert x["disk_served_gbps"] > 0 and x["ceiling_disk_gbps"] == max(out["disk_gbps"], x["disk_served_gbps"])
        assert x["ceiling_disk_s_per_token"] == pytest.approx(x["bytes_read_per_token"] / x["ceiling_disk_gbps"] / 1e9)
        worst = max(x["ceiling_memory_s_per_token"], x["ceiling_disk_s_per_token"])
        assert x["ceiling_tok_s"] == pytest.approx(1 / worst) and x["serial_ceiling_tok_s"] < x["ceiling_tok_s"]
    assert auto["ceiling_disk_s_per_token"] == 0 and auto["ceiling_bound"] == "memory"
    # a ceiling is a bound: no run above it (the tiny model's steps are far from it; 5 % for the bandwidth's drift)
    assert all(x["fraction_of_ceiling"] <= 1.05 for x in out["runs"])
    # the budget asked beside what the cache holds: whole experts, at most the bank
    assert small["ram_budget_asked"] == 400 * 1024 and auto["ram_budget_asked"] == "auto"
    assert small["ram_budget_bytes"] == small["ram_budget_bytes"] // stride * stride <= 400 * 1024
    assert auto["ram_budget_bytes"] == auto["expert_bank_bytes"] == small["expert_bank_bytes"]


def test_decode_ceiling_overlaps_the_disk_with_memory():
    """The parts of a paged run on flash4.fst (--ram-budget 500M, lru, 8 tokens): 1.11 GB resident (head screened)
    and 0.32 GB of experts a token at a 67 % hit rate, 0.15 GB a token read from disk; memory 22.0 GB/s, the disk
    1.09 GB/s (its fastest probe). It decoded 6.67 tok/s: the additive model (misses' bytes at the disk's rate on
    top of the memory time) said 5.79 tok/s, 115 %. The reads overlap compute: a token takes at least the larger
    time, 7.24 tok/s."""
    from fastar.bench.model import decode_ceiling, fastest_disk_gbps

    resident, experts, hit, read = 1_110_490_292, 320_864_256, 0.671875, 150_405_120
    probes = {"direct_GBps": 0.936, "direct_2threads_GBps": 1.088, "pagecache_GBps": 4.8}
    membw, disk = 22.046, fastest_disk_gbps(probes)
    assert disk == 1.088  # the cold probes only: a page-cache re-read is not the disk
    c = decode_ceiling(resident, experts, hit, read, membw, disk)
    memory_s, disk_s = (resident + hit * experts) / (membw * 1e9), read / (disk * 1e9)
    assert c["memory_s"] == pytest.approx(memory_s) and c["disk_s"] == pytest.approx(disk_s)
    assert c["seconds"] == pytest.approx(max(memory_s, disk_s)) and c["bound"] == "disk"
    assert c["serial_seconds"] == pytest.approx(memory_s + disk_s)
    assert 1 / c["seconds"] >= 6.668  # what the run did: under its ceiling
    # every expert in RAM: nothing read, the memory time alone (the model before this one, unchanged there)
    warm = decode_ceiling(resident, experts, 1.0, 0, membw, disk)
    assert warm["seconds"] == warm["serial_seconds"] == pytest.approx((resident + experts) / (membw * 1e9))


def test_batched_ceiling_counts_each_calls_experts_and_overlaps_the_disk():
    """flash4.fst, `--streams 1,4` with every expert in RAM: a 1-row call routes 24 experts, a 4-row one 55 (their
    union), 1.11 GB resident each, memory 18.6 and 18.3 GB/s. The probe missed the C router's experts, so the byte
    ceilings were the resident bytes alone: 4 streams 4.6x 1 stream. A call of N rows reads at least one row's
    bytes, so at one bandwidth N rows get at most N x the tokens per second."""
    from fastar.bench.model import StepBytes
    from fastar.bench.streams import _call_seconds, window_seconds

    resident, stride = 1_110_490_292, 13_369_344
    step = StepBytes(resident, stride)  # (no head screen)
    one = _call_seconds(step, (0.0, 1, 24, 0, 0), 18.56)
    four = _call_seconds(step, (0.0, 4, 55, 0, 0), 18.29)
    assert one == pytest.approx((resident + 24 * stride) / 18.56e9)
    ratio = (4 / four) / (1 / one)
    assert ratio == pytest.approx(3.06, abs=0.01) and ratio * 18.56 / 18.29 <= 4  # at one bandwidth: at most 4x
    # a miss's bytes go to the disk's time, which overlaps the calls' memory time: the larger of the two
    miss = _call_seconds(step, (0.0, 1, 24, 3, 0), 18.56)
    assert miss == pytest.approx((resident + 21 * stride) / 18.56e9)
    assert window_seconds([miss] * 10, 30 * stride, 1.0) == pytest.approx(max(10 * miss, 30 * stride / 1e9))
    assert window_seconds([miss] * 10, 30 * stride, 0.0) == pytest.approx(10 * miss)  # disk unknown: not counted
    # with the head screen (calls of up to 8 rows): its int8 head in place of the BF16 one, and the rows computed
    screened = StepBytes(1000, 10, screen_delta=-400, row_bytes=2, screen_rows=8)
    assert screened(4, 3, exact=5) == 1000 - 400 + 5 * 2 + 3 * 10 and screened(9, 3) == 1000 + 3 * 10
    assert screened(4, 3, exact=5, misses=1) == screened(4, 2, exact=5)


def test_streams_line_prints_no_rate_over_no_call_and_says_a_partial_window(monkeypatch, capsys):
    """A row whose window holds no decode call (the flags that lead there are refused, `check_arguments`) prints no
    rate: it said "0.0 tok/s aggregate over 0 calls"; one where no call carried all N streams (prompts longer than
    a chunk) says so beside its rate."""
    from fastar.bench import streams
    from fastar.cli import build_parser

    row = {
        "streams": 2,
        "aggregate_decode_tok_s": 0.0,
        "batched_ceiling_tok_s": None,
        "roofline_tok_s": None,
        "fraction_of_ceiling": None,
        "fraction_of_roofline": None,
        "window_calls": 0,
        "window_rows_per_call": 0.0,
        "window_all_streams": False,
        "window_read_bytes": 0,
        "per_stream_tok_s": [0.0, 0.0],
        "itl_p50_ms": 0.0,
        "itl_p95_ms": 0.0,
        "identical_to_solo": True,
    }
    partial = row | {"streams": 4, "aggregate_decode_tok_s": 50.0, "window_calls": 2, "window_rows_per_call": 1.5}
    partial |= {"per_stream_tok_s": [40.0, 60.0, 50.0, 45.0], "itl_p50_ms": 20.0, "itl_p95_ms": 25.0}
    head = {"model": "m.fst", "membw_gbps": 10.0, "fma_peak_gflops": 100.0, "quant_path_gflops": 100.0}
    head |= {"decode_macs_fp32_path": 1e9, "decode_macs_quant_path": 1e9, "tokens": 3, "head_screen": False}
    monkeypatch.setattr(streams, "bench", lambda *a, **k: head | {"rows": [row, partial]})
    a = build_parser().parse_args(["bench", "-m", "m.fst", "--streams", "2,4", "--decode-tokens", "5"])
    assert streams.main(a) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "  2 streams: no decode call timed; raise --decode-tokens", lines
    assert "4 streams: 50.0 tok/s aggregate" in lines[2] and "no call carried all 4 streams" in lines[2], lines
    assert " 0.0 tok/s" not in "\n".join(lines) and "over 0 calls" not in "\n".join(lines)


def test_budget_line_says_what_was_asked_and_what_the_cache_holds():
    from fastar.bench.model import budget_asked, budget_line

    stride, bank = 13_369_344, 80 * 13_369_344
    run = {"ram_budget_asked": 2 << 30, "ram_budget_bytes": bank, "expert_bank_bytes": bank, "expert_bytes": stride}
    assert budget_asked(run) == "2G"
    assert budget_line(run) == "budget 2G (2.15 GB) asked: 1.07 GB, every expert (the bank is 1.07 GB)"
    run.update(ram_budget_asked=500 << 20, ram_budget_bytes=39 * stride)
    assert budget_line(run) == "budget 500M (0.52 GB) asked: 0.52 GB, 39 of 80 experts (the bank is 1.07 GB)"
    run.update(ram_budget_asked="auto", ram_budget_bytes=bank)
    assert budget_asked(run) == "auto" and budget_line(run).startswith("budget auto: 1.07 GB, every expert")
    run.update(ram_budget_asked="none", ram_budget_bytes=0)
    assert budget_line(run) == "budget none: the file mapped, no expert cache"


def test_bench_model_runs_with_the_thread_count_asked(tiny_ckpt, tmp_path):
    """`bench -m --threads N` sizes the kernels' pool as `run --threads` does (it was ignored: the run used every
    CPU); a list, which `bench kernels` takes, is one line for a model benchmark. The plot's file is named."""
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    png = tmp_path / "curve.png"
    args = ("-m", str(fst), "--json", "--prompt-tokens", "4", "--decode-tokens", "2", "--warmup-tokens", "0")
    r = _bench(*args, "--threads", "1", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["threads"] == 1
    assert f"written to {png}" in r.stderr and png.exists()
    r = _bench(*args, "--threads", "1,2")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.endswith("(a list is for `fastar bench kernels`)\n") and r.stderr.count("\n") == 1, r.stderr
    r = _bench(*args, "--ram-budget", "1G,12X")  # a typo in the list names its flag, as run's --ram-budget does
    assert r.returncode == 1 and r.stderr.startswith("fastar: error: --ram-budget: cannot read '12X' as a size")


def test_bench_times_sampled_steps_against_the_full_heads_ceiling(tiny_ckpt, tmp_path):
    """--temperature times sampled steps: the full LM head (the screen's bytes not in the ceiling), the settings in
    the JSON and the table; bad values and a draft with it are usage errors."""
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    args = ["-m", str(fst), "--prompt-tokens", "6", "--decode-tokens", "3", "--warmup-tokens", "1"]
    greedy = json.loads(_bench(*args, "--json").stdout)
    r = _bench(*args, "--json", "--temperature", "0.8", "--top-p", "0.9")
    assert r.returncode == 0, r.stderr
    sampled = json.loads(r.stdout)
    assert sampled["sampling"] == {"temperature": 0.8, "top_p": 0.9} and greedy["sampling"]["temperature"] == 0
    assert greedy["head_screen_bytes_per_token"] < 0 and sampled["head_screen_bytes_per_token"] == 0
    assert sampled["ceiling_tok_s"] < greedy["ceiling_tok_s"] * sampled["membw_gbps"] / greedy["membw_gbps"]
    table = _bench(*args, "--temperature", "0.8")
    assert table.returncode == 0 and "(sampled: temperature 0.8, top_p 1)" in table.stdout
    for bad, says in (
        (["--temperature", "-1"], "argument --temperature: a temperature must be between 0 and 100, got -1"),
        (["--temperature", "nan"], "argument --temperature: a temperature must be between 0 and 100, got nan"),
        (["--top-p", "0"], "argument --top-p: top-p must be above 0 and at most 1, got 0"),
        (["--temperature", "1", "--replay", "0.5"], "drop --draft and --replay"),
    ):
        r = _bench(*args, *bad)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, bad


def test_bench_reports_speculative_statistics(tiny_ckpt, tmp_path):
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    r = _bench(
        "-m",
        str(fst),
        "--ram-budget",
        "auto",
        "--draft",
        "mtp",
        "--prompt-tokens",
        "6",
        "--decode-tokens",
        "6",
    )
    assert r.returncode == 0, r.stderr
    assert "draft mtp:" in r.stdout and "tokens per verify pass" in r.stdout
    assert "same tokens as plain: yes" in r.stdout
    r = _bench(
        "-m",
        str(fst),
        "--ram-budget",
        "auto",
        "--replay",
        "1",
        "--prompt-tokens",
        "6",
        "--decode-tokens",
        "9",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["draft_mode"] == "replay:1" and out["draft_same_tokens"]
    assert out["draft_acceptance_rate"] == 1.0 and out["draft_tokens_per_pass"] >= 4.0  # 4 drafts, all right


def test_each_run_uses_the_bandwidth_measured_around_it(tiny_ckpt, tmp_path, monkeypatch):
    from fastar.bench import model as bench

    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    r = bench.run(str(fst), ["auto"], prompt_tokens=4, decode_tokens=2, warmup=1)
    assert r["runs"][0]["repeats"][0]["membw_before_after_gbps"] is None  # a tiny head stays in cache: start probe
    assert r["runs"][0]["membw_gbps"] == r["membw_gbps"]
    monkeypatch.setattr(bench, "PROBE_MIN_BYTES", 0)  # stream the tiny head anyway
    run = bench.run(str(fst), ["auto"], prompt_tokens=4, decode_tokens=2, warmup=1)["runs"][0]
    before, after = run["repeats"][0]["membw_before_after_gbps"]
    assert before > 0 and after > 0 and run["membw_gbps"] == (before + after) / 2
    per_token = r["resident_bytes_per_token"] + run["head_screen_bytes_per_token"] + r["expert_bytes_per_token"]
    assert abs(run["ceiling_tok_s"] - run["membw_gbps"] * 1e9 / per_token) < 1e-6 * run["ceiling_tok_s"]


def test_repeats_each_against_their_own_bandwidth(tiny_ckpt, tmp_path, monkeypatch):
    from fastar.bench import model as bench

    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    monkeypatch.setattr(bench, "PROBE_MIN_BYTES", 0)
    run = bench.run(str(fst), ["auto"], prompt_tokens=4, decode_tokens=2, warmup=1, repeats=3)["runs"][0]
    assert run["decode_tokens"] == 6 and len(run["repeats"]) == 3
    for x in run["repeats"]:
        assert x["membw_gbps"] > 0 and x["decode_tok_s"] > 0
        assert abs(x["fraction_of_ceiling"] - x["decode_tok_s"] / x["ceiling_tok_s"]) < 1e-9
    assert abs(run["membw_gbps"] - sum(x["membw_gbps"] for x in run["repeats"]) / 3) < 1e-9
    r = _bench(
        "-m",
        str(fst),
        "--ram-budget",
        "auto",
        "--prompt-tokens",
        "4",
        "--decode-tokens",
        "2",
        "--repeats",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "2 repeats: % of ceiling median" in r.stdout
    assert "budget auto: " in r.stdout and ", every expert (the bank is " in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "fastar", "bench", "-m", str(fst), "--repeats", "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode != 0 and "--repeats" in r.stderr


def test_bench_compares_with_transformers_in_bfloat16(tiny_ckpt, tmp_path):
    """--compare-transformers DIR: the same weights in transformers (bfloat16) and fastar, prefill and decode of
    both printed from one run; the prefill's fraction of the bf16 dot peak where the CPU has that path."""
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    args = [
        sys.executable,
        "-m",
        "fastar",
        "bench",
        "-m",
        str(fst),
        "--ram-budget",
        "auto",
        "--prompt-tokens",
        "20",
        "--decode-tokens",
        "3",
        "--compare-transformers",
        str(tiny_ckpt),
    ]
    r = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    t = out["transformers"]
    assert t["dtype"] == "bfloat16" and t["prefill_tok_s"] > 0 and t["decode_tok_s"] > 0
    assert t["prefill_logits_positions"] == 1  # the LM head on the last position only, as generate() prefills
    assert t["threads"] == out["threads"]  # the cores fastar's kernels use (not the one torch thread it leaves)
    assert abs(out["prefill_speedup_vs_transformers"] - out["prefill_tok_s"] / t["prefill_tok_s"]) < 1e-9
    # every expert in RAM: both engines prefill the prompt twice, the first after load timed apart
    assert out["runs"][0]["preloaded"] and out["runs"][0]["prefill_first_tok_s"] > 0 and t["prefill_first_tok_s"] > 0
    from fastar.quant import kernels as K

    if "avx512bf16" in (K.cpu_features()["usable_isas"] if K.available() else []):
        assert out["bf16_peak_gflops"] > 0 and out["runs"][0]["prefill_fraction_of_bf16_peak"] > 0
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "transformers bfloat16" in r.stdout and "fastar / transformers" in r.stdout and "first prefill" in r.stdout
    r = subprocess.run(args[:-1] + [str(tmp_path / "nope")], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "not a checkpoint directory" in r.stderr and "Traceback" not in r.stderr


def test_decode_macs_split_by_instruction_path(tiny_ckpt, tmp_path):
    """`decode_macs`: the BF16/F32 weights' products (LM head, routers, ...) on one side, the FP8 products and the
    k routed experts per layer on the other, every resident product but the embedding counted once; the same
    split from the checkpoint directory and from its `.fst`."""
    from fastar.bench.model import decode_macs, prefill_macs

    fst = FstFile(convert(tiny_ckpt, tmp_path / "m.fst", progress=False))
    cfg = fst.config
    wide, quant = decode_macs(fst)
    head = cfg.vocab_size * cfg.hidden_size
    experts = cfg.num_hidden_layers * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    fp8 = sum(
        fst.tensor(n).shape[0] * fst.tensor(n).shape[1]
        for n in fst.names()
        if n.endswith(".weight") and fst.dtype(n) == "F8_E4M3" and not n.startswith("mtp.")
    )
    assert fp8 > 0 and quant == fp8 + experts
    assert wide > head  # the head and the routers' gates at least
    assert wide + quant == prefill_macs(fst) + head  # the prefill's count leaves out only the head
    ckpt = open_source(str(tiny_ckpt))  # names every routed expert's matrices: counted as k per token, not as resident
    assert decode_macs(ckpt) == (wide, quant) and prefill_macs(ckpt) == prefill_macs(fst)


def test_bench_profile_counts_waits_for_expert_reads_apart(tiny_ckpt, tmp_path, monkeypatch):
    """A paged model whose expert reads are slow: the MoE's waits for them are their own category, carved out of
    the MoE's bookkeeping (which stays >= 0), and the categories still add up to the step."""
    import time as _time

    from fastar.bench import profile
    from fastar.weights import expert_store

    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    read = expert_store.ExpertReader.read

    def slow_read(self, layer, e, buf):
        _time.sleep(0.01)
        return read(self, layer, e, buf)

    monkeypatch.setattr(expert_store.ExpertReader, "read", slow_read)
    src = open_source(str(fst))
    budget = 2 * src.expert_stride  # two experts' room: every step reads again
    src.close()
    p = profile.bench(str(fst), [1], steps=3, prompt_tokens=4, ram_budget=budget)["profiles"][0]
    cats = p["categories_ms"]
    assert p["expert_stall_ms"] > 5 and cats[profile.STALL] == p["expert_stall_ms"]
    assert cats["outside: MoE (rest)"] >= 0 and sum(cats.values()) == pytest.approx(p["step_ms"], rel=1e-9)
    parts = p["kernels_ms"] + p["torch_ops_ms"] + p["outside_kernels_ms"] + p["expert_stall_ms"]
    assert parts == pytest.approx(p["step_ms"], rel=1e-9)


def test_bench_profile_splits_a_decode_step(tiny_ckpt, tmp_path):
    """--profile 1,3: each step's categories (C kernels by kind, torch ops, the time outside kernels) add up to the
    step, the kinds a decode step runs are all there, and the engine's C extension is put back afterwards."""
    from fastar.bench import profile
    from fastar.model import ops, state
    from fastar.model.deepseek_v4 import HyperConnection, MoE
    from fastar.quant import kernels

    ops_post, moe_call = HyperConnection.post, MoE.__call__
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    r = _bench("-m", str(fst), "--profile", "1,3", "--decode-tokens", "2", "--prompt-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [p["rows"] for p in out["profiles"]] == [1, 3] and out["preloaded"]
    for p in out["profiles"]:
        cats = p["categories_ms"]
        assert all(v >= 0 for v in cats.values())
        assert sum(cats.values()) == pytest.approx(p["step_ms"], rel=1e-9)
        parts = p["kernels_ms"] + p["torch_ops_ms"] + p["outside_kernels_ms"] + p["expert_stall_ms"]
        assert parts == pytest.approx(p["step_ms"], rel=1e-9) and p["expert_stall_ms"] == 0  # every expert preloaded
        # (the RMS norms of a decode step run inside the mHC and fused attention calls)
        kinds = ("FP8 products", "BF16 products", "FP4 experts", "attention", "mHC", "attention products (fused)")
        for k in (*kinds, "routing/top-k"):
            assert cats[k] > 0, k
        assert cats["sampling"] > 0 and p["calls_per_step"]["sampling"] == p["rows"]
        assert p["calls_per_step"]["FP4 experts"] == p["calls_per_step"]["routing/top-k"]  # one fused call per layer
        assert 0 < p["outside_kernels_fraction"] < 1 and p["product_gbps"]["FP8 products"] > 0
        # the glue less the timers' own cost: a positive cost per timed call, taken off the outside time and the step
        assert p["timed_calls_per_step"] > 10 and 0 < p["timers_ms"] < p["outside_kernels_ms"]
        assert p["outside_kernels_net_ms"] == pytest.approx(p["outside_kernels_ms"] - p["timers_ms"])
        net = p["outside_kernels_net_ms"] / (p["step_ms"] - p["timers_ms"])
        assert p["outside_kernels_net_fraction"] == pytest.approx(net) and net < p["outside_kernels_fraction"]
        for k in ("step", "attention q/kv projections", "attention core", "shared expert", "mHC wrappers"):
            assert cats["outside: " + k] > 0, k
        assert cats["outside: LM head (rest)"] > 0  # the head's Python after the final norm, apart from the step's
        # the mHC sites chained (`hc_chain`): one C call per wrapper call, the head's collapse in the last one
        assert p["calls_per_step"]["outside: mHC wrappers"] == p["calls_per_step"]["mHC"]
        assert set(p["categories_cpu_ms"]) == set(cats) and p["outside_kernels_cpu_ms"] > 0
    # the instrumentation is gone once the profile is done (in this process too)
    run = profile.bench(str(fst), [2], steps=1, prompt_tokens=4)
    assert run["profiles"][0]["rows"] == 2
    assert ops._C is kernels._C is state._C is kernels.extension and type(ops._C).__name__ == "module"
    assert HyperConnection.post is ops_post and MoE.__call__ is moe_call
    bad = _bench("-m", str(fst), "--profile", "9")
    assert bad.returncode != 0 and "--profile" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_profile_byte_floor_falls_back_on_the_machine_probe(tiny_ckpt, tmp_path, monkeypatch):
    """A model whose LM head is too small to measure the memory bandwidth with (the fixtures', the demo model's)
    printed no byte floor under --profile, while --streams fell back on the machine's 1 GiB probe: both take it now
    (`model.MemoryBandwidth`), measured once a run, and the line says the GB/s is the probe's."""
    from fastar.bench import kernels as bench_kernels
    from fastar.bench import profile

    probes = []
    monkeypatch.setattr(bench_kernels, "read_gbps", lambda: probes.append(1) or 12.5, raising=False)  # 1 call: below
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    r = profile.bench(str(fst), [1, 2], steps=1, prompt_tokens=4)
    assert len(probes) == 1
    for p in r["profiles"]:
        assert p["membw_gbps"] == 12.5 and p["membw_source"] == "probe"
        assert p["byte_floor_ms"] == pytest.approx(1e3 * p["step_bytes"] / 12.5e9) and p["step_bytes"] > 0
    lines = [x for x in profile.format_profile(r).splitlines() if "row(s) at position" in x]
    assert len(lines) == 2, lines
    for line in lines:
        assert "byte floor" in line and "at 12.5 GB/s" in line and "% of it); the GB/s is this machine's 1 GiB" in line


def test_bench_profile_byte_floor_counts_the_experts_each_step_routed_to(vocab_ckpt, monkeypatch):
    """--profile's byte floor: a step's bytes are counted by `StepBytes`, the count `--streams`' ceiling takes (it
    left out every routed expert once the C router took over routing, `route_c`): the resident bytes, the head
    screen's, and the distinct experts the step's rows routed to, here counted apart from the experts the fused MoE
    sums were handed in each profiled step (the demo model's widths: the `vocab` preset)."""
    import numpy as np

    from fastar.bench import profile
    from fastar.bench.model import StepBytes
    from fastar.engine.engine import load
    from fastar.model import moe_fused

    steps: list[list[int]] = []  # per profiled (wall-clock) step: the distinct experts of each MoE call
    summed, timed_step = moe_fused.routed_sum, profile._step

    def routed_sum(xa, routed, *args, **kw):
        if steps and steps[-1] is not None:
            steps[-1].append(len(np.unique(np.asarray(routed))))
        return summed(xa, routed, *args, **kw)

    def step(model, samplers, pending, states, clock):
        steps.append([] if clock is not None and not clock.cpu else None)
        return timed_step(model, samplers, pending, states, clock)

    monkeypatch.setattr(moe_fused, "routed_sum", routed_sum)
    monkeypatch.setattr(profile, "_step", step)
    out = profile.bench(str(vocab_ckpt), [1, 4], steps=2, prompt_tokens=4)
    with load(vocab_ckpt) as engine:
        count, cfg = StepBytes.of(engine), engine.config
    profiled = [s for s in steps if s is not None]
    assert len(profiled) == 4 and all(len(s) == cfg.num_hidden_layers for s in profiled)  # one MoE call a layer
    for p, used in zip(out["profiles"], (profiled[:2], profiled[2:])):
        experts = sum(map(sum, used)) / len(used)
        assert p["experts_per_step"] == experts >= cfg.num_hidden_layers * cfg.num_experts_per_tok
        assert p["step_bytes"] == count(p["rows"], experts, p["exact_head_rows_per_step"])
        assert p["step_bytes"] - count(p["rows"], 0, p["exact_head_rows_per_step"]) == experts * count.stride > 0
    # a row routes to exactly k experts a layer
    assert out["profiles"][0]["experts_per_step"] == cfg.num_hidden_layers * cfg.num_experts_per_tok


def test_bench_profile_prefill_splits_a_prefill(tiny_ckpt, tmp_path):
    """--profile-prefill 5,40: each prompt's categories add up to the profiled prefill, the row ops a prefill runs
    are apart (RoPE, activation rounding) beside the products, whose FLOPs are counted from their calls' shapes, and
    the engine's C extension is put back afterwards; a bad length or --repeats is a one-line error."""
    from fastar.bench import profile_prefill
    from fastar.model import ops, state
    from fastar.quant import kernels

    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    r = _bench("-m", str(fst), "--profile-prefill", "5,40", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [p["tokens"] for p in out["profiles"]] == [5, 40] and out["preloaded"]
    for p in out["profiles"]:
        cats = p["categories_ms"]
        assert all(v >= 0 for v in cats.values()) and sum(cats.values()) == pytest.approx(p["run_ms"], rel=1e-9)
        for k in ("FP8 products", "BF16 products", "FP4 experts", "attention", "mHC", "RoPE", "activation rounding"):
            assert cats[k] > 0, k
        assert p["calls_per_run"]["outside: step"] == 1 and 0 < p["outside_kernels_fraction"] < 1
        assert set(p["product_gflops"]) >= {"FP8 products", "FP4 experts"} and min(p["product_gflops"].values()) > 0
    text = profile_prefill.format_profile(out)
    assert "40 tokens" in text and "GFLOP/s" in text
    assert ops._C is kernels._C is state._C is kernels.extension and type(ops._C).__name__ == "module"
    for bad, flag in (
        (["--profile-prefill", "0"], "--profile-prefill"),
        (["--profile-prefill", "5,x"], "--profile-prefill"),
        (["--profile-prefill", "5", "--repeats", "0"], "--repeats"),  # the flag at fault
    ):
        got = _bench("-m", str(fst), *bad)
        assert got.returncode == 2 and f"argument {flag}: " in got.stderr and got.stderr.count("\n") == 1


def test_prefill_flops_count_each_products_multiply_adds():
    """The FLOPs a prefill profile gives each product call: 2 x rows x weight elements, a grouped FP8 product's
    groups and a routed expert's own tokens (packed FP4: two weights a byte) included."""
    import numpy as np

    from fastar.bench.profile_prefill import _flops

    x = np.zeros((7, 64), np.float32)
    assert _flops("fp8_matmul", (x, np.zeros((32, 64), np.uint8), None, None)) == 2 * 7 * 32 * 64
    assert _flops("bf16_matmul", (x, np.zeros((10, 64), np.uint16), None)) == 2 * 7 * 10 * 64
    grouped = np.zeros((7, 4 * 16), np.float32)  # 4 groups of 16 inputs, 8 outputs each
    assert _flops("fp8_matmul", (grouped, np.zeros((4 * 8, 16), np.uint8), None, None, 4)) == 2 * 7 * 4 * 8 * 16
    d, inter = 64, 32
    ew = (np.zeros((inter, d // 2), np.uint8), None, np.zeros((inter, d // 2), np.uint8), None,
          np.zeros((d, inter // 2), np.uint8), None)  # fmt: skip
    offsets = np.array([0, 3, 5])  # expert 0: 3 tokens, expert 1: 2
    assert _flops("experts_ffn", (x, [ew, ew], None, offsets)) == 2 * 5 * 3 * d * inter
    assert _flops("shared_ffn", (x, np.zeros((2 * inter, d), np.uint8), None, np.zeros((d, inter), np.uint8))) == (
        2 * 7 * 3 * d * inter
    )
    assert _flops("rope", (x,)) == 0
