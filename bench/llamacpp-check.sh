#!/usr/bin/env bash
# fastar against llama.cpp on the same weights, the engines alternated, in one command (issue 33's llama.cpp goals):
#
#   LLAMA_CPP=/path/to/llama.cpp bash bench/llamacpp-check.sh
#
# LLAMA_CPP is a llama.cpp source tree with the `deepseek4` graph (for example the one vendored in the
# llama-cpp-python sdist on PyPI: llama_cpp_python-*/vendor/llama.cpp). Once, and reused after: builds
# llama-bench and llama-batched-bench there (cmake, -DGGML_NATIVE=ON, Release, at nice 19; in $LLAMA_CPP/build or
# $LLAMA_BUILD) and converts the 4-layer Flash-width checkpoint $BIG/flash4-hf to $BIG/flash4-mxfp4.gguf with
# llama.cpp's own convert_hf_to_gguf.py (routed experts kept as MXFP4, the checkpoint's own FP4 bits; FP8 weights
# dequantized and requantized to Q8_0; bfloat16 and float32 tensors as they are). The models come from
# bench/decode-check.sh (or `fastar synth --hf-dir $BIG/flash4-hf --layers 4 --experts 16` and `fastar convert`).
#
# Then, ROUNDS times (default 2), alternating fastar (A) and llama.cpp (B) on THREADS threads (default 2):
#   1. one stream: `fastar bench --prompt-tokens 64 --decode-tokens 32` decode tok/s against
#      `llama-bench -n 32 -d 64 -p 0` (tg32 at depth 64; its mean over 5 repetitions);
#   2. streams: `fastar bench --streams 4,8 --prompt-tokens 16 --decode-tokens 32` aggregate tok/s against
#      `llama-batched-bench -npp 16 -ntg 32 -npl 4,8` S_TG;
# and once, for information, prefill: fastar pp64 (from the one-stream runs) and pp512 against
# `llama-bench -p 64,512 -n 0`. Each engine reads its weights into RAM before it is timed: fastar with every expert
# preloaded (--ram-budget auto), llama.cpp with `-lm none` (read, not memory-mapped: on a shared machine the page
# cache is evicted between runs, and a mapped model then reads from disk in its first timed repetition, measured
# here at 2.4 against 14-15 tok/s for the next four). Beside each figure is the memory read
# bandwidth measured in the same run: fastar's own (its LM head streamed around the decode), and for llama.cpp
# fastar's read-bandwidth probe (`fastar.bench.kernels.machine_limits`, 1 GiB, best of 5) just before and just
# after it. The summary gives each round's ratio against the goals (one stream >= 1.25x, 4 and 8 streams >= 2x).
#
# Each timed run (with its probes) holds the lock $LOCK (default /tmp/bench.lock; LOCK=none for none), so do
# not wrap the whole script in flock. About 6 minutes on 2 cores once built (the build: ~10 minutes).
#
# Environment: LLAMA_CPP=DIR (required), BIG=DIR (the models, default $TMPDIR/fastar-big, /tmp without TMPDIR),
# GGUF=FILE (default $BIG/flash4-mxfp4.gguf), THREADS=N (2), ROUNDS=N (2), LLAMA_BUILD=DIR, LOCK=FILE|none,
# OUT=DIR (the JSON and logs of every run; default a temporary folder, printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
step() { printf '\n== %s  [%ds]\n' "$*" $((SECONDS - T0)) >&2; }
die() {
    printf 'llamacpp-check: error: %s\n' "$*" >&2
    exit 1
}

[[ -n "${LLAMA_CPP:-}" ]] || die "set LLAMA_CPP=DIR to a llama.cpp source tree with the deepseek4 graph (e.g. llama-cpp-python's sdist, vendor/llama.cpp)"
[[ -f "$LLAMA_CPP/CMakeLists.txt" && -f "$LLAMA_CPP/convert_hf_to_gguf.py" ]] \
    || die "$LLAMA_CPP is not a llama.cpp source tree (no CMakeLists.txt and convert_hf_to_gguf.py)"
[[ -f "$LLAMA_CPP/src/models/deepseek4.cpp" ]] || die "$LLAMA_CPP has no deepseek4 graph (src/models/deepseek4.cpp): too old a llama.cpp"
BIG=${BIG:-${TMPDIR:-/tmp}/fastar-big}
HF=$BIG/flash4-hf
FST=$BIG/flash4.fst
GGUF=${GGUF:-$BIG/flash4-mxfp4.gguf}
[[ -f "$HF/config.json" ]] || die "no checkpoint at $HF (make it with bench/decode-check.sh, or set BIG=DIR)"
[[ -f "$FST" ]] || die "no $FST (fastar convert $HF -o $FST, or set BIG=DIR)"
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive integer, not '$THREADS'"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer, not '$ROUNDS'"
export FASTAR_THREADS=$THREADS
LLAMA_BUILD=${LLAMA_BUILD:-$LLAMA_CPP/build}
LOCK=${LOCK:-/tmp/bench.lock}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT" || die "cannot create $OUT"
FASTAR=(python -m fastar)
BENCH=$LLAMA_BUILD/bin/llama-bench
BATCHED=$LLAMA_BUILD/bin/llama-batched-bench

if [[ ! -x "$BENCH" || ! -x "$BATCHED" ]]; then
    step "building llama-bench and llama-batched-bench in $LLAMA_BUILD (once, at nice 19; log $OUT/build.log)"
    command -v cmake >/dev/null || die "cmake not found (needed to build llama.cpp)"
    { nice -n 19 cmake -S "$LLAMA_CPP" -B "$LLAMA_BUILD" -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF \
        && nice -n 19 cmake --build "$LLAMA_BUILD" -j "$(nproc)" --target llama-bench llama-batched-bench; } \
        >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log" >&2; die "building llama.cpp failed (log: $OUT/build.log)"; }
fi
if [[ ! -f "$GGUF" ]]; then
    step "converting $HF to $GGUF with llama.cpp's convert_hf_to_gguf.py (once, at nice 19)"
    PYTHONPATH="$LLAMA_CPP/gguf-py" nice -n 19 python "$LLAMA_CPP/convert_hf_to_gguf.py" --outtype auto \
        --outfile "$GGUF.part" "$HF" >"$OUT/convert.log" 2>&1 \
        || { tail -20 "$OUT/convert.log" >&2; die "convert_hf_to_gguf.py failed (log: $OUT/convert.log)"; }
    mv "$GGUF.part" "$GGUF"
fi

if [[ "$LOCK" != none ]]; then
    exec 9>>"$LOCK" || die "cannot open the lock $LOCK (LOCK=none for no lock)"
fi
lock() { if [[ "$LOCK" != none ]]; then flock 9; fi; }
unlock() { if [[ "$LOCK" != none ]]; then flock -u 9; fi; }

# memory read bandwidth (GB/s) on $THREADS threads, fastar's probe; appended to $1
probe() {
    python -c 'import sys; from fastar.bench.kernels import machine_limits; n = int(sys.argv[1]); print(round(machine_limits([n])["membw"][n], 2))' \
        "$THREADS" >>"$1" || die "the bandwidth probe failed (is the C extension built?)"
}

# a timed run under the lock: stdout to $OUT/NAME.json, stderr to $OUT/NAME.log (shown when it fails); for
# llama.cpp (WITH_PROBE=1) the bandwidth probed just before and after it goes to $OUT/NAME.bw
run() {
    local name=$1
    shift
    lock
    rm -f "$OUT/$name.bw"
    if [[ "${WITH_PROBE:-0}" == 1 ]]; then probe "$OUT/$name.bw"; fi
    "$@" >"$OUT/$name.json" 2>"$OUT/$name.log" || {
        unlock
        tail -20 "$OUT/$name.log" >&2
        die "$name failed: $*"
    }
    if [[ "${WITH_PROBE:-0}" == 1 ]]; then probe "$OUT/$name.bw"; fi
    unlock
}

for r in $(seq 1 "$ROUNDS"); do
    step "round $r/$ROUNDS: one stream, fastar (64-token prompt, 32 tokens decoded)"
    run "fastar-1-r$r" "${FASTAR[@]}" bench -m "$FST" --ram-budget auto --prompt-tokens 64 --decode-tokens 32 --json
    step "round $r/$ROUNDS: one stream, llama-bench -n 32 -d 64 -p 0 -t $THREADS"
    WITH_PROBE=1 run "llama-1-r$r" "$BENCH" -m "$GGUF" -lm none -n 32 -d 64 -p 0 -t "$THREADS" -o json
    step "round $r/$ROUNDS: 4 and 8 streams, fastar (16-token prompts, 32 tokens each)"
    run "fastar-n-r$r" "${FASTAR[@]}" bench -m "$FST" --streams 4,8 --prompt-tokens 16 --decode-tokens 32 --json
    step "round $r/$ROUNDS: 4 and 8 streams, llama-batched-bench -npp 16 -ntg 32 -npl 4,8 -t $THREADS"
    WITH_PROBE=1 run "llama-n-r$r" "$BATCHED" -m "$GGUF" -lm none -c 1024 -npp 16 -ntg 32 -npl 4,8 -t "$THREADS" \
        --output-format jsonl
done
step "prefill (for information): fastar pp512"
run fastar-pp512 "${FASTAR[@]}" bench -m "$FST" --ram-budget auto --prompt-tokens 512 --decode-tokens 4 --json
step "prefill (for information): llama-bench -p 64,512 -n 0 -r 2 -t $THREADS"
WITH_PROBE=1 run llama-pp "$BENCH" -m "$GGUF" -lm none -p 64,512 -n 0 -r 2 -t "$THREADS" -o json

step "summary"
python - "$OUT" "$ROUNDS" <<'EOF'
import json
import sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])


def load(name):
    return json.loads((out / f"{name}.json").read_text())


def jsonl(name):  # llama-batched-bench prints its rows as JSON lines among its log lines
    lines = (out / f"{name}.json").read_text().splitlines()
    return [json.loads(x) for x in lines if x.startswith("{")]


def bw(name):
    b = [float(x) for x in (out / f"{name}.bw").read_text().split()]
    return f"memory {b[0]:.1f} -> {b[1]:.1f} GB/s"


def ok(flag):
    return "MET" if flag else "not met"


print("one stream (decode tok/s; llama.cpp: llama-bench tg32 at depth 64, mean of its repetitions):")
ratios = []
for r in range(1, rounds + 1):
    f = load(f"fastar-1-r{r}")
    (t,) = load(f"llama-1-r{r}")
    ratio = f["decode_tok_s"] / t["avg_ts"]
    ratios.append(ratio)
    print(
        f"  round {r}: fastar {f['decode_tok_s']:.2f} (memory {f['runs'][0]['membw_gbps']:.1f} GB/s around its "
        f"decode), llama.cpp {t['avg_ts']:.2f} +- {t['stddev_ts']:.2f} (repetitions {min(t['samples_ts']):.2f}-"
        f"{max(t['samples_ts']):.2f}; {bw(f'llama-1-r{r}')}) -> {ratio:.2f}x"
    )
print(f"  ratio {min(ratios):.2f}-{max(ratios):.2f}x  goal >= 1.25x: {ok(min(ratios) >= 1.25)}")
for n in (4, 8):
    print(f"{n} streams (aggregate decode tok/s; llama.cpp: llama-batched-bench S_TG):")
    ratios = []
    for r in range(1, rounds + 1):
        (f,) = [x for x in load(f"fastar-n-r{r}")["rows"] if x["streams"] == n]
        (t,) = [x for x in jsonl(f"llama-n-r{r}") if x["pl"] == n]
        ratio = f["aggregate_decode_tok_s"] / t["speed_tg"]
        ratios.append(ratio)
        print(
            f"  round {r}: fastar {f['aggregate_decode_tok_s']:.1f} (memory {f['membw_gbps']:.1f} GB/s around it; "
            f"identical_to_solo {f['identical_to_solo']}), llama.cpp {t['speed_tg']:.1f} ({bw(f'llama-n-r{r}')}) "
            f"-> {ratio:.2f}x"
        )
    print(f"  ratio {min(ratios):.2f}-{max(ratios):.2f}x  goal >= 2x: {ok(min(ratios) >= 2)}")
pp = {x["n_prompt"]: x for x in load("llama-pp")}
fast = {64: [load(f"fastar-1-r{r}")["prefill_tok_s"] for r in range(1, rounds + 1)], 512: [load("fastar-pp512")["prefill_tok_s"]]}
print(f"prefill tok/s (for information; llama-bench -p 64,512 -n 0, {bw('llama-pp')}):")
for n in (64, 512):
    f = fast[n]
    print(
        f"  pp{n}: fastar {', '.join(f'{x:.1f}' for x in f)}, llama.cpp {pp[n]['avg_ts']:.1f} "
        f"-> {min(f) / pp[n]['avg_ts']:.2f}-{max(f) / pp[n]['avg_ts']:.2f}x"
    )
print(f"JSON and logs of every run: {out}")
EOF
step "done"
