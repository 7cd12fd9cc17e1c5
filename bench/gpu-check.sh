#!/usr/bin/env bash
# The accelerator tier's check (issue 21), one command on a CUDA machine from a fresh clone, in under 8 minutes:
#
#   bash bench/gpu-check.sh
#
# 1. installs fastar into .venv-gpu (torch from PyPI's default wheel, which carries CUDA; a torch already installed
#    system-wide is reused), 2. runs the tests marked `gpu`, 3. writes a Flash-width synthetic model (4 layers x 256
#    experts, the real widths and vocabulary), 4. benchmarks it three ways with a 4,096-token prompt:
#      cpu     --device cpu                       the C kernels, every expert in RAM
#      device  --device cuda --gpu-budget auto    everything on the GPU (the pool holds every expert)
#      split   --device cuda --gpu-budget B       B = this model's share of what a 24 GB card leaves for experts
#    and prints prefill and decode tok/s of each and the ratios against the issue's goals (decode >= 2x, prefill of
#    4,096 tokens >= 10x the CPU-only path).
#
# DRY=1 runs the same steps with --device torch:cpu on a small model and no install (the plumbing, on any machine).
# LAYERS=, PROMPT=, DECODE= change the model's layers (4), the prompt (4096) and the decode tokens (32).
# WORK=DIR keeps the model there (default: a temporary folder, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
step() { printf '\n== %s  [%ds]\n' "$*" $((SECONDS - T0)); }
die() { printf 'gpu-check: error: %s\n' "$*" >&2; exit 1; }

DRY=${DRY:-0}
WORK=${WORK:-}
if [[ -z "$WORK" ]]; then
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"

if [[ "$DRY" == 1 ]]; then
    DEVICE=torch:cpu
    SYNTH=(--layers 2 --experts 16 --vocab 1024 --hidden 512 --inter 256 --mtp 0)
    PROMPT=300 DECODE=4 WARMUP=2
    PY=${PYTHON:-python3}
else
    DEVICE=cuda
    SYNTH=(--layers "${LAYERS:-4}" --experts 256 --mtp 0)
    PROMPT=${PROMPT:-4096} DECODE=${DECODE:-32} WARMUP=8
    step "install (.venv-gpu)"
    if [[ ! -x .venv-gpu/bin/python ]]; then
        python3 -m venv --system-site-packages .venv-gpu
    fi
    PY=.venv-gpu/bin/python
    if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        "$PY" -m pip install -q torch  # PyPI's default Linux wheel is the CUDA build
    fi
    # the test extras (transformers for the exactness tests); offline with them preinstalled, fastar alone
    "$PY" -m pip install -q -e '.[test]' || "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
        || die "torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA device"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
FASTAR=("$PY" -m fastar)
"$PY" -c 'import torch, fastar; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, fastar {fastar.__version__}")'

step "tests marked gpu"
"$PY" -m pytest -q -p no:randomly -m gpu tests/

step "synthetic Flash-width model: ${SYNTH[*]}"
MODEL="$WORK/gpu-check.fst"
[[ -f "$MODEL" ]] || "${FASTAR[@]}" synth -o "$MODEL" "${SYNTH[@]}"

# This model's share of a 24 GB card: the card less the full model's resident weights (43 layers) and a 2 GiB
# reserve, spread over the full model's 43 layers, times this model's layers.
BUDGET=$("$PY" - "$MODEL" "$DRY" <<'EOF'
import sys

from fastar.format.reader import FstFile

with FstFile(sys.argv[1]) as f:
    cfg, sizes = f.config, {t["name"]: t["nbytes"] for t in f.header["tensors"]}
    outside = sum(n for k, n in sizes.items() if not k.startswith(("layers.", "mtp.")))  # embed, head, norms
    per_layer = (sum(sizes.values()) - outside) / cfg.num_hidden_layers
    full_resident = outside + 43 * per_layer
    share = (24 * 2**30 - full_resident - 2 * 2**30) / 43 * cfg.num_hidden_layers
    expert = f.bank["stride"]
    if sys.argv[2] == "1":  # the small dry model: a third of its bank
        share = f.bank["slots"] * f.bank["experts"] * expert / 3
    print(int(share))
    print(f"24 GB card: full-model resident {full_resident / 2**30:.1f} GiB; expert budget for this model's "
          f"{cfg.num_hidden_layers} layers {share / 2**30:.2f} GiB = {share / expert:.0f} of its "
          f"{f.bank['slots'] * f.bank['experts']} experts", file=sys.stderr)
EOF
)

run() {  # name, device, budget -> $WORK/name.json
    local name=$1 device=$2 budget=$3
    step "bench $name: --device $device --gpu-budget $budget"
    "${FASTAR[@]}" bench -m "$MODEL" --device "$device" --gpu-budget "$budget" --prompt-tokens "$PROMPT" \
        --decode-tokens "$DECODE" --warmup-tokens "$WARMUP" --json >"$WORK/$name.json"
}
run cpu cpu auto
run device "$DEVICE" auto
run split "$DEVICE" "$BUDGET"

step "results"
"$PY" - "$WORK" "$PROMPT" <<'EOF'
import json
import sys

work, prompt = sys.argv[1], int(sys.argv[2])
rows = {n: json.load(open(f"{work}/{n}.json")) for n in ("cpu", "device", "split")}
cpu = rows["cpu"]
print(f"{'run':8} {'device':10} {'prefill tok/s':>14} {'decode tok/s':>13} {'x cpu prefill':>14} {'x cpu decode':>13}"
      f" {'experts on device':>18} {'peak VRAM':>10}")
for name, r in rows.items():
    dev = r.get("device_experts_device", 0)
    n = max(1, dev + r.get("device_experts_cpu", 0))
    peak = f"{r['device_peak_bytes'] / 2**30:.1f} GiB" if "device_peak_bytes" in r else "-"
    share = f"{100 * dev / n:.0f}%" if name != "cpu" else "-"
    print(f"{name:8} {r.get('device', 'cpu'):10} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.2f} "
          f"{r['prefill_tok_s'] / cpu['prefill_tok_s']:13.1f}x {r['decode_tok_s'] / cpu['decode_tok_s']:12.2f}x "
          f"{share:>18} {peak:>10}")
split = rows["split"]
print(f"goals (split, 24 GB budget): decode >= 2x cpu: {split['decode_tok_s'] / cpu['decode_tok_s']:.2f}x; "
      f"prefill of {prompt} tokens >= 10x cpu: {split['prefill_tok_s'] / cpu['prefill_tok_s']:.1f}x")
for name in ("device", "split"):
    r = rows[name]
    print(f"{name}: pool {r['device_pool_n_slots']} slots, {r['device_pool_hits']} hits, {r['device_pool_misses']} "
          f"misses, {r['device_pool_admitted']} admitted, {r['device_pool_bytes_copied'] / 2**30:.2f} GiB copied; "
          f"{r['device_experts_streamed']} experts streamed, CPU experts {r['device_cpu_seconds']:.2f} s, "
          f"waited {r['device_wait_seconds']:.2f} s")
EOF
step "done"
