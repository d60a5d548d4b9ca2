"""docs/design.md "Layout" and "Style": imports run downward only, checked by import-linter's contracts in
pyproject.toml; a module is one idea, so none in the package is over MODULE_LINES_MAX lines."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES_MAX = 400


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        found = shutil.which("lint-imports")
        if found is None:
            pytest.skip("import-linter is not installed (it is in the test extra: pip install -e '.[test]')")
        lint = Path(found)
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_no_module_in_the_package_is_over_400_lines():
    sources = sorted((ROOT / "shmbroker").rglob("*.py"))
    assert sources, "no sources found under shmbroker/"
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sources}
    over = {name: n for name, n in lines.items() if n > MODULE_LINES_MAX}
    assert over == {}, f"over {MODULE_LINES_MAX} lines (split by idea): {over}"
