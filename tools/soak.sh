#!/usr/bin/env bash
# Soak the broker under chaos: tests/supervisor/test_chaos.py with SHMBROKER_SOAK_ITERATIONS iterations per
# victim (default 200). Extra arguments go to pytest (e.g. -k supervisor, -x).
#   tools/soak.sh                       # 200 iterations per victim
#   SHMBROKER_SOAK_ITERATIONS=20 tools/soak.sh -k 'sched or results'
#   SHMBROKER_CHAOS_SEED=20261187 SHMBROKER_SOAK_ITERATIONS=1 tools/soak.sh -k supervisor   # one failing iteration again
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    echo "soak: $PY not found; run 'make install' first" >&2
    exit 2
fi
export SHMBROKER_SOAK_ITERATIONS="${SHMBROKER_SOAK_ITERATIONS:-200}"
echo "soak: $SHMBROKER_SOAK_ITERATIONS iterations per victim, seed ${SHMBROKER_CHAOS_SEED:-default}" >&2
exec "$PY" -m pytest -q tests/supervisor/test_chaos.py "$@"
