#!/usr/bin/env bash
# The device check: one short script for a machine with an NVIDIA GPU and a bare Python image
# (CPython 3.12 with torch, transformers, numba, prometheus-client and rich; no posix_ipc, no crc32c,
# no package index). Prepare it on a machine that has the index, in the repository root:
#
#     make gpu-wheels     # .wheels/ (ignored): cp312 manylinux wheels of posix_ipc and crc32c,
#                         # pytest, its dependencies and pytest-timeout, the trace's first items
#
# and run it on the device machine from a copy of the working tree that carries .wheels:
#
#     tools/gpu_check.sh  # OUT=logs folder (./gpu-check), SCALE=bench gpu --scale (0.2),
#                         # BUDGET=seconds for all of it (290), PY=interpreter (python3),
#                         # WHEELS=the wheels folder (.wheels)
#
# Steps, each under `timeout` and all within BUDGET (about 5 minutes on an H200):
#  1. install what does not import, from .wheels only (pip --no-index; where pip is missing or
#     refuses, e.g. an externally managed Python, the wheels are unpacked into .gpu-site/ on
#     PYTHONPATH). The project is not installed: it runs from this tree with PYTHONPATH=$PWD;
#  2. record nvidia-smi and the versions of python, torch (its CUDA), transformers, numba;
#  3. warm the numba kernels: supervisor/warmup.py's parts compiled side by side into the on-disk cache, then
#     `shmbroker warm` (loads them all, compiles whatever a part left);
#  4. the hf engine's GPU tests: tests/engines/test_engine_hf.py -k gpu (with bench gpu's small CPU run);
#  5. `shmbroker bench gpu --json`: the hf engine on the card fed by the broker, against FIFO and
#     against the engine alone (transformers' own batching of every item in arrival order), and the
#     consumer loop's overhead, in process and through a live broker.
# Logs go to $OUT; the last thing printed is ONE JSON object (also $OUT/summary.json): the device,
# versions, install, each step's exit status and seconds, the tests' outcome, bench gpu's figures.
# tools/gpu_check.py is its Python side.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
SCALE=${SCALE:-0.2}
BUDGET=${BUDGET:-290}
WHEELS=${WHEELS:-$ROOT/.wheels}
SITE=$ROOT/.gpu-site
HELP=$ROOT/tools/gpu_check.py
mkdir -p "${OUT:-./gpu-check}"
OUT=$(cd "${OUT:-./gpu-check}" && pwd)
: > "$OUT/steps.txt"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
START=$SECONDS
RESERVE=0 # seconds of BUDGET a step leaves for the steps after it

# step NAME CAP CMD...: CMD under `timeout` (CAP seconds, at most what BUDGET has left less RESERVE),
# stdout to $OUT/NAME.out, stderr to $OUT/NAME.err, "NAME rc seconds" to $OUT/steps.txt
step() {
    local name=$1 cap=$2 t0=$SECONDS rc
    shift 2
    local left=$((BUDGET - (SECONDS - START) - RESERVE))
    ((left < cap)) && cap=$left
    if ((cap < 5)); then
        echo "skipped: no time left of BUDGET=$BUDGET" > "$OUT/$name.err"
        echo "$name 124 0" >> "$OUT/steps.txt"
        return 124
    fi
    timeout --kill-after=10 "$cap" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
    rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$OUT/steps.txt"
    echo "gpu_check: $name rc=$rc in $((SECONDS - t0)) s" >&2
    return $rc
}

# 1. install from .wheels only
mapfile -t NEED < <("$PY" "$HELP" missing)
HOW=none-needed
if ((${#NEED[@]})); then
    HOW=pip
    if ! step install 90 "$PY" -m pip install --no-index --find-links "$WHEELS" "${NEED[@]}"; then
        HOW=unpacked
        step unpack 60 "$PY" "$HELP" unpack "$WHEELS" "$SITE"
        export PYTHONPATH=$SITE:$PYTHONPATH
    fi
fi
echo "$HOW ${NEED[*]}" > "$OUT/install.txt"

# 2. the card and the versions
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.csv" 2>&1
step versions 60 "$PY" "$HELP" versions

# 3. the numba kernels
step warm_parts 150 "$PY" "$HELP" warm-parts
step warm 150 "$PY" -m shmbroker.cli warm

# 4. the hf engine's GPU tests, keeping time back for the bench
RESERVE=180
step tests 100 "$PY" -m pytest -q -p no:cacheprovider tests/engines/test_engine_hf.py -k gpu --junitxml "$OUT/tests.xml"
RESERVE=0

# 5. bench gpu on the card, on the trace's first items when they came along in .wheels
TRACE=()
[[ -f $WHEELS/trace.jsonl ]] && TRACE=(--trace "$WHEELS/trace.jsonl")
step bench_gpu 240 "$PY" -m shmbroker.cli bench gpu --json --scale "$SCALE" "${TRACE[@]}"

"$PY" "$HELP" summary "$OUT" "$SCALE" "$BUDGET" "$((SECONDS - START))" | tee "$OUT/summary.json"
