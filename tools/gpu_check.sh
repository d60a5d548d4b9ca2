#!/usr/bin/env bash
# The device check for issue 7, as one short script for a machine with an NVIDIA GPU (torch and
# transformers installed; no network): the hf engine's GPU tests, then `bench gpu` on the card.
# Writes its output under ${OUT:-./gpu-check}. Budget: about 5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-check}
mkdir -p "$OUT"
PY=${PY:-python3}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -m pip install --quiet --no-deps -e . > "$OUT/install.txt" 2>&1
$PY -m shmbroker.cli warm > "$OUT/warm.txt" 2>&1
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_engine_hf.py -k "gpu" > "$OUT/tests.txt" 2>&1
echo "tests: $?" >> "$OUT/tests.txt"
timeout 420 $PY -m shmbroker.cli bench gpu --json --scale 0.5 > "$OUT/bench_gpu.json" 2> "$OUT/bench_gpu.err"
echo "bench gpu: $?"
cat "$OUT/tests.txt" | tail -3
cat "$OUT/bench_gpu.json"
