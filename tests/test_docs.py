"""The documentation stays true: README.md and docs/*.md against the repository they describe.

- every relative link resolves to an existing file inside the repository, and every `#anchor` to a
  heading of its page (GitHub's heading slugs);
- every file path named in them exists: a path under `shmbroker/`, `tests/`, `tools/` or `docs/`,
  or any path ending in `.py` or `.sh`, resolved against the repository root, then against
  `shmbroker/`; a bare module name (`watchdog.py`) must be some file of the repository;
- README.md is one screen: at most README_LINES_MAX lines, `make demo` and `make test` within its
  first 15, a Producer example of at most 10 lines within its first 80;
- the README's own walk-through works: its configuration runs a broker, its Producer example gets
  its results, and its `shmbroker submit` line writes one `ok` result a prompt;
- no tracker references (the word "issue" or "hole" followed by a number) in the documentation or in
  the package.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from support.brokerproc import BrokerProc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_LINES_MAX = 250
SETUP_LINES = 15  # `make demo` and `make test` within these
EXAMPLE_LINES = 80  # the Producer example ends within these
EXAMPLE_LINES_MAX = 10
# written on its own branch (generated from the settings fields); linked to from here
CONFIGURATION_PAGE = DOCS / "configuration.md"

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
# A repository path: under a top-level folder of the repository, or a Python or shell file.
PATH = re.compile(r"(?<![\w./<>*~$-])((?:shmbroker|tests|tools|docs)/[\w./-]*|[\w.-]+(?:/[\w.-]+)*\.(?:py|sh)\b)")
TRACKER = re.compile(r"\b(?:issue|hole)s?\s+#?[0-9]+", re.IGNORECASE)
ISSUE = re.compile(r"\b(issue|hole)s? [0-9]+", re.IGNORECASE)  # tracker references: `grep -rniE "(issue|hole)s? [0-9]+"`


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[list[tuple[int, str]]]]:
    """(prose lines, fenced blocks), each line with its 1-based number."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            if block is None:
                block = [(number, line)]
            else:
                block.append((number, line))
                blocks.append(block)
                block = None
        elif block is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    assert block is None, "a code fence is never closed"
    return prose, blocks


def slugs(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated slug numbered -1, -2, ..."""
    prose, _ = split_fences(page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code."""
    prose, _ = split_fences(page.read_text())
    found = []
    for number, line in prose:
        plain = CODE_SPAN.sub(lambda m: "x" * len(m.group(0)) if "](" not in m.group(0) else m.group(0), line)
        found.extend((number, target) for target in LINK.findall(plain))
    return found


def named_paths(page: Path) -> list[tuple[int, str]]:
    """(line, path) of every repository path named on a page, code included."""
    found = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for m in PATH.finditer(line):
            found.append((number, m.group(1).rstrip(".")))
    return found


def repository_files() -> set[str]:
    names = set()
    for top in ("shmbroker", "tests", "tools", "docs"):
        names.update(p.name for p in (ROOT / top).rglob("*") if p.is_file())
    names.update(p.name for p in ROOT.iterdir() if p.is_file())
    return names


def test_the_pages_exist():
    assert README.is_file()
    names = {p.name for p in PAGES}
    for page in ("design.md", "client.md", "operations.md", "jobs.md", "cluster.md", "engines.md", "benchmarks.md",
                 "contributing.md"):
        assert page in names, f"docs/{page} is missing"


def test_the_configuration_reference_exists():
    assert CONFIGURATION_PAGE.is_file()


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    anchors = {}
    broken = []
    for number, target in links(page):
        if SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{rel(page)}:{number}: {target}"
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{where} (outside the repository)")
            continue
        if not dest.exists():
            broken.append(f"{where} (no such file)")
            continue
        if anchor:
            if dest.suffix != ".md":
                broken.append(f"{where} (an anchor into a file that is not a page)")
                continue
            if dest not in anchors:
                anchors[dest] = slugs(dest)
            if anchor not in anchors[dest]:
                broken.append(f"{where} (no heading with that anchor)")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_named_file_exists(page):
    files = repository_files()
    missing = []
    for number, path in named_paths(page):
        if "/" not in path.rstrip("/"):
            if path.rstrip("/") not in files and not (ROOT / path).exists():
                missing.append(f"{rel(page)}:{number}: {path} (no file of that name in the repository)")
            continue
        if not ((ROOT / path).exists() or (ROOT / "shmbroker" / path).exists()):
            missing.append(f"{rel(page)}:{number}: {path}")
    assert missing == []


def test_the_path_pattern_finds_what_it_should():
    line = ("see `spill/layout.py`, shmbroker/ring/spsc.py, `tools/grafana/prometheus.yml`, tests/support/brokerproc.py, "
            "watchdog.py, `<data_dir>/results/cursor.json`, ~/.cache/shmbroker/numba and tests/<package>/test_*.py.")
    found = [m.group(1).rstrip(".") for m in PATH.finditer(line)]
    assert found == ["spill/layout.py", "shmbroker/ring/spsc.py", "tools/grafana/prometheus.yml",
                     "tests/support/brokerproc.py", "watchdog.py", "tests/"]


def test_slugs_follow_github():
    page = DOCS / "design.md"
    names = slugs(page)
    assert "why-it-exists-measured-not-assumed" in names
    assert "resultscursorjson" in names  # ### `results/cursor.json`
    assert "feeding-an-engine-keep-it-full-in-the-brokers-order" in names


def test_the_readme_is_one_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_LINES_MAX
    head = lines[:SETUP_LINES]
    assert any(line.strip().startswith("make demo") for line in head), "`make demo` is not in the first lines"
    assert any(line.strip().startswith("make test") for line in head), "`make test` is not in the first lines"


def producer_example() -> tuple[int, int, str]:
    """(first line, last line, code) of the README's first Python block that makes a Producer."""
    _, blocks = split_fences(README.read_text())
    for block in blocks:
        code = "\n".join(line for _, line in block[1:-1])
        if block[0][1].strip().startswith("```python") and "Producer(" in code:
            return block[0][0], block[-1][0], code
    raise AssertionError("README.md has no Python block making a Producer")


def test_the_readme_has_a_short_producer_example_early():
    first, last, code = producer_example()
    assert last <= EXAMPLE_LINES, f"the Producer example ends at line {last}"
    assert len([line for line in code.splitlines() if line.strip()]) <= EXAMPLE_LINES_MAX
    compile(code, "README.md", "exec")


def readme_block(lang: str, contains: str) -> str:
    _, blocks = split_fences(README.read_text())
    for block in blocks:
        code = "\n".join(line for _, line in block[1:-1])
        if block[0][1].strip() == f"```{lang}" and contains in code:
            return code
    raise AssertionError(f"README.md has no {lang or 'plain'} block with {contains!r}")


@pytest.mark.timeout(240)
def test_the_readme_walk_through_works(tmp_path):
    """The README's configuration runs a broker (with small rings for a test machine); its Producer
    example prints one `ok` result a prompt; its `shmbroker submit` line, on a file holding its prompt
    line, writes one `ok` row a prompt."""
    config = readme_block("toml", "[[consumers]]")
    small = "ingest_ring_bytes = 1048576\nresult_ring_bytes = 1048576\nsegment_bytes = 4194304\nindex_items = 65536\n"
    _, _, example = producer_example()
    submit = next(line.split("#")[0].split() for line in readme_block("", "shmbroker submit").splitlines()
                  if line.startswith("shmbroker submit"))
    line = json.loads(readme_block("", '{"tokens"'))  # the README's prompt line, and two more
    asked = [line, *({"tokens": [7, 8, 9 + i], "max_new_tokens": 4, "id": f"more-{i}"} for i in range(2))]
    prompts = tmp_path / submit[2]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in asked))
    with BrokerProc(tmp_path, config=small + config, instance="d" + secrets.token_hex(4)) as broker:
        env = {**os.environ, "SHMBROKER_DATA_DIR": broker.data_dir}
        run = subprocess.run([sys.executable, "-c", example + "\nprint('SUBMITTED', len(ids))"], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        *rows, submitted = [line.split() for line in run.stdout.splitlines()]
        assert submitted[0] == "SUBMITTED" and len(rows) == int(submitted[1]) > 0, run.stdout
        assert all(row[1] == "ok" for row in rows), run.stdout
        assert len({row[0] for row in rows}) == len(rows)
        run = subprocess.run([sys.executable, "-m", "shmbroker.cli", *submit[1:]], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        out = [json.loads(line) for line in (tmp_path / submit[submit.index("--out") + 1]).read_text().splitlines()]
        assert sorted(r["id"] for r in out) == sorted(row["id"] for row in asked)
        assert all(r["status"] == "ok" for r in out)


def test_no_tracker_references_in_the_documentation():
    found = [f"{rel(page)}:{n}: {line.strip()}" for page in PAGES
             for n, line in enumerate(page.read_text().splitlines(), 1) if TRACKER.search(line)]
    assert found == []


def test_no_documentation_points_outside_the_repository():
    """The design used to live beside the repository; every clone must find it inside."""
    needle = "shared/" + "DESIGN"
    found = []
    for top in ("shmbroker", "tests", "tools", "docs"):
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".md", ".sh", ".toml", ".yml", ".json") and needle in path.read_text():
                found.append(rel(path))
    for path in (README, ROOT / "Makefile", ROOT / "pyproject.toml"):
        if needle in path.read_text():
            found.append(rel(path))
    assert found == []


def test_no_issue_numbers_in_the_package_or_the_documentation():
    found = []
    for path in [*sorted((ROOT / "shmbroker").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")), *PAGES]:
        found += [f"{rel(path)}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert found == []
