"""docs/design.md "Layout" and "Style": imports run downward only, checked by import-linter's contracts in
pyproject.toml (packages, not modules, in at most 16 lines); a module is one idea, so none in the
package is over MODULE_LINES_MAX lines, no function over FUNCTION_LINES_MAX; no module imports
another's private names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
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


FUNCTION_LINES_MAX = 80
LAYER_LINES_MAX = 16


def _package_sources():
    return sorted((ROOT / "shmbroker").rglob("*.py"))


def test_no_function_in_the_package_is_over_80_lines():
    over = []
    for path in _package_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES_MAX:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert over == [], f"functions over {FUNCTION_LINES_MAX} lines (split by idea): {over}"


def test_no_module_imports_a_private_name_from_another():
    found = []
    for path in _package_sources():
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports too
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == [], f"private names imported across modules (make them public or keep them home): {found}"


def _layers() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        contracts = tomllib.load(fh)["tool"]["importlinter"]["contracts"]
    (layered,) = [c for c in contracts if c["type"] == "layers"]
    return layered["layers"]


def test_the_import_contract_names_every_package_once_in_at_most_16_lines():
    layers = _layers()
    assert len(layers) <= LAYER_LINES_MAX
    named = [name.strip() for line in layers for name in line.replace(":", "|").split("|")]
    assert len(named) == len(set(named)), f"a package named twice: {named}"
    assert all("." not in name for name in named), f"the contract names packages, not modules: {named}"
    rooms = {p.name for p in (ROOT / "shmbroker").iterdir() if (p / "__init__.py").is_file()}
    rooms |= {p.stem for p in (ROOT / "shmbroker").glob("*.py") if p.stem != "__init__"}
    assert set(named) == rooms, f"packages missing from the contract: {sorted(rooms - set(named))}; " \
                                f"named but absent: {sorted(set(named) - rooms)}"
