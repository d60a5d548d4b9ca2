"""The numba atomics between real processes, and the kernel cache: keyed on all kernel sources, never recompiled in a fork.

Atomics: forked processes hammer one int64 in a shared-memory `Segment` with
fetch_add and with a compare_and_swap loop, and pass messages with
store_release / load_acquire. Every spin is bounded inside the kernel and
yields between rounds in Python, so a loaded two-core machine slows the test
down instead of hanging it.

Cache: `jit.sources_digest()` must change when any kernel source changes
(helpers such as the atomics included), a fresh process must leave its
compiled kernels under `<cache root>/<digest>/`, and a forked child must run
its parent's compiled kernels without compiling or loading anything.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numba
import numpy as np
import pytest
from numba.core.dispatcher import Dispatcher

import shmbroker
from shmbroker import jit
from shmbroker.ring import digest, items, spsc
from shmbroker.ring import layout as L
from shmbroker.ring.atomics import (
    compare_and_swap,
    cpu_pause,
    fetch_add,
    load_acquire,
    load_relaxed,
    store_release,
)
from shmbroker.ring.owned import create_ring
from shmbroker.ring.ring import CONSUMER, PRODUCER
from shmbroker.ring.shm import Segment

pytestmark = pytest.mark.timeout(60)

DEV_SHM = Path("/dev/shm")
PACKAGE_DIR = Path(shmbroker.__file__).resolve().parent
JOIN_SECONDS = 30.0
SUBPROCESS_SECONDS = 50.0
SPINS = 200_000  # pause-spins per kernel call before it returns to Python to yield




def _child_main(conn, target, args) -> None:
    try:
        conn.send(("done", target(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_forked(targets_and_args: list[tuple], timeout: float = JOIN_SECONDS) -> list:
    """Run each (target, *args) in its own forked process at once; return their results in order."""
    ctx = mp.get_context("fork")
    running = []
    try:
        for target, *args in targets_and_args:
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_child_main, args=(child_conn, target, tuple(args)), daemon=True)
            proc.start()
            child_conn.close()
            running.append((proc, parent_conn))
        results = []
        deadline = time.monotonic() + timeout
        for proc, conn in running:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"child {proc.pid} gave no answer within {timeout} s")
            kind, value = conn.recv()
            if kind == "error":
                raise AssertionError(f"child {proc.pid} failed:\n{value}")
            results.append(value)
        for proc, _ in running:
            proc.join(JOIN_SECONDS)
            assert proc.exitcode == 0, f"child {proc.pid} exit code {proc.exitcode}"
        return results
    finally:
        for proc, conn in running:
            if proc.is_alive():
                proc.kill()
            proc.join(JOIN_SECONDS)
            conn.close()


# --- atomics across processes --------------------------------------------------------------

# int64 word layout of the shared test segment (one idea per 128-byte block)
W_READY = 0  # start barrier
W_COUNTER = 16  # the contended counter
W_FLAG = 32  # message passing: round published by the writer
W_ACK = 48  # message passing: round seen by the reader
W_PAYLOAD = 64  # message passing: PAYLOAD_WORDS words
PAYLOAD_WORDS = 16
SEGMENT_WORDS = 128
NOT_YET = -1  # kernels: the spin budget ran out; call again after a yield


@numba.njit(nogil=True)
def k_arrive(a, idx):
    fetch_add(a, idx, 1)


@numba.njit(nogil=True)
def k_await_count(a, idx, count, spins):
    """True once a[idx] >= count; False when `spins` pauses pass first."""
    for _ in range(spins):
        if load_acquire(a, idx) >= count:
            return True
        cpu_pause()
    return False


@numba.njit(nogil=True)
def k_fetch_add_loop(a, idx, n):
    """n atomic increments; returns (value before the first, value before the last)."""
    first = fetch_add(a, idx, 1)
    last = first
    for _ in range(n - 1):
        last = fetch_add(a, idx, 1)
    return first, last


@numba.njit(nogil=True)
def k_cas_loop(a, idx, n):
    """n increments by compare-and-swap retry loops; returns (first seen, last seen, retries)."""
    retries = 0
    first = -1
    last = -1
    for i in range(n):
        old = load_relaxed(a, idx)
        while True:
            seen = compare_and_swap(a, idx, old, old + 1)
            if seen == old:
                break
            old = seen
            retries += 1
        if i == 0:
            first = old
        last = old
    return first, last, retries


@numba.njit(nogil=True)
def payload_word(r, j):
    return r * 1_000_003 + j * 7919 + 1


@numba.njit(nogil=True)
def k_write_rounds(a, start, rounds, spins):
    """Rounds start..rounds: write the payload (plain stores), release the flag, await the ack.

    Returns the next round to do (rounds + 1 when all are done)."""
    for r in range(start, rounds + 1):
        if load_acquire(a, W_FLAG) != r:
            for j in range(PAYLOAD_WORDS):
                a[W_PAYLOAD + j] = payload_word(r, j)
            store_release(a, W_FLAG, r)
        k = 0
        while load_acquire(a, W_ACK) != r:
            cpu_pause()
            k += 1
            if k > spins:
                return r
    return rounds + 1


@numba.njit(nogil=True)
def k_read_rounds(a, start, rounds, spins, bad):
    """Rounds start..rounds: acquire the flag, check the payload (plain loads), release the ack.

    bad[0] counts payload words that did not match; returns the next round to do."""
    for r in range(start, rounds + 1):
        k = 0
        while load_acquire(a, W_FLAG) != r:
            cpu_pause()
            k += 1
            if k > spins:
                return r
        for j in range(PAYLOAD_WORDS):
            if a[W_PAYLOAD + j] != payload_word(r, j):
                bad[0] += 1
        store_release(a, W_ACK, r)
    return rounds + 1


@pytest.fixture(scope="module")
def compiled_test_kernels():
    """Compile the test kernels once in this process, so forked children only run them."""
    a = np.zeros(SEGMENT_WORDS, np.int64)
    k_arrive(a, W_READY)
    k_await_count(a, W_READY, 1, 1)
    k_fetch_add_loop(a, W_COUNTER, 2)
    k_cas_loop(a, W_COUNTER, 2)
    bad = np.zeros(1, np.int64)
    k_write_rounds(a, 1, 0, 1)
    k_read_rounds(a, 1, 0, 1, bad)


@pytest.fixture
def shared_words(owner, compiled_test_kernels):
    seg = owner.segment("atomics", SEGMENT_WORDS * 8)
    words = seg.buf.view(np.int64)
    assert (words == 0).all()
    return seg.name, words


def attach_words(name: str) -> tuple[Segment, np.ndarray]:
    seg = Segment.attach(name)
    return seg, seg.buf.view(np.int64)


def start_together(a: np.ndarray, parties: int, timeout: float = 20.0) -> None:
    """Barrier on the shared ready word, bounded, yielding between spin rounds."""
    k_arrive(a, W_READY)
    deadline = time.monotonic() + timeout
    while not k_await_count(a, W_READY, parties, SPINS):
        assert time.monotonic() < deadline, "the other process never arrived"
        os.sched_yield()


def add_with_fetch_add(name: str, n: int):
    seg, a = attach_words(name)
    try:
        start_together(a, 2)
        first, last = k_fetch_add_loop(a, W_COUNTER, n)
        return int(first), int(last)
    finally:
        del a
        seg.close()


def add_with_cas(name: str, n: int):
    seg, a = attach_words(name)
    try:
        start_together(a, 2)
        first, last, retries = k_cas_loop(a, W_COUNTER, n)
        return int(first), int(last), int(retries)
    finally:
        del a
        seg.close()


INCREMENTS = 1_000_000


def test_fetch_add_across_processes_loses_nothing(shared_words):
    name, words = shared_words
    results = run_forked([(add_with_fetch_add, name, INCREMENTS)] * 2)
    assert int(words[W_COUNTER]) == 2 * INCREMENTS
    # fetch_add hands out every value once: each process saw distinct "before" values in its range.
    for first, last in results:
        assert 0 <= first < last < 2 * INCREMENTS
        assert last - first >= INCREMENTS - 1
    firsts = sorted(r[0] for r in results)
    assert firsts[0] == 0


def test_compare_and_swap_loop_across_processes_loses_nothing(shared_words):
    name, words = shared_words
    results = run_forked([(add_with_cas, name, INCREMENTS)] * 2)
    assert int(words[W_COUNTER]) == 2 * INCREMENTS
    # Retries count the CAS that lost a race (about 10 % of them when both run on their own core;
    # none when time-sliced on one): the total is exact either way.
    for first, last, retries in results:
        assert 0 <= first < last < 2 * INCREMENTS
        assert last - first >= INCREMENTS - 1
        assert retries >= 0
    assert sorted(r[0] for r in results)[0] == 0


def message_side(name: str, role: str, rounds: int) -> int:
    """Run all rounds as the writer or the reader; returns the count of bad payload words seen."""
    seg, a = attach_words(name)
    try:
        start_together(a, 2)
        bad = np.zeros(1, np.int64)
        nxt = 1
        deadline = time.monotonic() + 30.0
        while nxt <= rounds:
            if role == "writer":
                nxt = k_write_rounds(a, nxt, rounds, SPINS)
            else:
                nxt = k_read_rounds(a, nxt, rounds, SPINS, bad)
            if nxt <= rounds:
                assert time.monotonic() < deadline, f"{role} stuck at round {nxt}"
                os.sched_yield()
        return int(bad[0])
    finally:
        del a
        seg.close()


def test_release_acquire_message_passing_across_processes(shared_words):
    name, words = shared_words
    rounds = 200_000
    bad_writer, bad_reader = run_forked([(message_side, name, "writer", rounds), (message_side, name, "reader", rounds)])
    assert bad_writer == 0
    assert bad_reader == 0, f"reader saw {bad_reader} payload words older than the flag"
    assert int(words[W_FLAG]) == int(words[W_ACK]) == rounds
    want = [payload_word(rounds, j) for j in range(PAYLOAD_WORDS)]
    assert words[W_PAYLOAD : W_PAYLOAD + PAYLOAD_WORDS].tolist() == want


# --- the cache is keyed on every kernel source ------------------------------------------------


def copy_package(dest: Path) -> Path:
    """Copy the installed package's sources to dest/shmbroker (no bytecode); return the copy."""
    target = dest / "shmbroker"
    shutil.copytree(PACKAGE_DIR, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def digest_in_subprocess(pythonpath: Path) -> tuple[str, str]:
    """(sources_digest, package file) computed by a fresh interpreter importing the package at pythonpath."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    code = "import shmbroker, shmbroker.jit as j; print(j.sources_digest()); print(shmbroker.__file__)"
    # cwd away from the checkout: `python -c` puts the working directory ahead of PYTHONPATH.
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=pythonpath, capture_output=True, text=True, timeout=SUBPROCESS_SECONDS
    )
    assert out.returncode == 0, out.stderr
    digest_hex, package_file = out.stdout.split()
    return digest_hex, package_file


def load_jit_copy(package: Path):
    """Load a copy's jit.py as a standalone module (it imports nothing of the package)."""
    spec = importlib.util.spec_from_file_location(f"jit_copy_{secrets.token_hex(4)}", package / "jit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stable_copy(tmp: Path) -> tuple[Path, str]:
    """A copy of the package whose sources match this process's digest (others may edit the tree meanwhile)."""
    for attempt in range(5):
        before = jit.sources_digest()
        copy = copy_package(tmp / f"snap{attempt}")
        if jit.sources_digest() == before:
            return copy, before
        time.sleep(0.2)
    pytest.skip("kernel sources kept changing while being copied")


def test_sources_digest_changes_when_a_helper_changes(tmp_path):
    unchanged, original = stable_copy(tmp_path / "a")
    edited = tmp_path / "b" / "shmbroker"
    shutil.copytree(unchanged, edited)
    atomics = edited / "ring" / "atomics.py"
    atomics.write_text(atomics.read_text() + "\n# a comment: no code changed, the digest must still change\n")

    same, same_file = digest_in_subprocess(unchanged.parent)
    changed, changed_file = digest_in_subprocess(edited.parent)
    assert Path(same_file).resolve().parent == unchanged.resolve()
    assert Path(changed_file).resolve().parent == edited.resolve()
    assert same == original
    assert changed != original
    assert re.fullmatch(r"[0-9a-f]{20}", changed)


def kernel_source_files() -> list[str]:
    return [str(p.relative_to(PACKAGE_DIR)) for p in jit._source_files()]


@pytest.mark.parametrize("relative", ["jit.py", "ring/layout.py", "ring/spsc.py", "ring/items.py", "ring/digest.py"])
def test_sources_digest_changes_with_each_kernel_source(tmp_path, relative):
    package, _ = stable_copy(tmp_path)
    base = load_jit_copy(package).sources_digest()
    path = package / relative
    path.write_text(path.read_text() + "\n# edited\n")
    assert load_jit_copy(package).sources_digest() != base


def test_sources_digest_covers_new_kernel_modules_and_ignores_other_files(tmp_path):
    package, _ = stable_copy(tmp_path)
    base = load_jit_copy(package).sources_digest()
    (package / "cli.py").write_text((package / "cli.py").read_text() + "\n# not a kernel source\n")
    assert load_jit_copy(package).sources_digest() == base
    (package / "ring" / "new_kernels.py").write_text("X = 1\n")
    assert load_jit_copy(package).sources_digest() != base


def test_every_module_with_kernels_is_a_kernel_source():
    covered = set(kernel_source_files())
    users = sorted(
        str(p.relative_to(PACKAGE_DIR))
        for p in PACKAGE_DIR.rglob("*.py")
        if re.search(r"^\s*@(jit\.)?kernel\b|numba\.njit|@njit", p.read_text(), re.M)
    )
    assert users, "no kernels found"
    assert [u for u in users if u not in covered] == []


def test_kernels_use_the_digest_cache_directory():
    for dispatcher in (items.push_item, spsc.push_many, spsc.pop_many, digest.digest_records):
        assert Path(dispatcher.stats.cache_path).is_relative_to(jit.CACHE_DIR), dispatcher.stats.cache_path
    assert jit.CACHE_DIR.name == jit.sources_digest()


CACHE_PROBE = """
import json, os
from shmbroker import jit
from shmbroker.ring import items
print(json.dumps({
    "digest": jit.sources_digest(),
    "cache_dir": str(jit.CACHE_DIR),
    "hits": sum(items.push_item.stats.cache_hits.values()),
    "misses": sum(items.push_item.stats.cache_misses.values()),
    "overloads": len(items.push_item.overloads),
    "signatures": len(items.push_item.signatures),
}))
"""


def probe_cache(cache_root: Path) -> dict:
    import json

    env = dict(os.environ, SHMBROKER_NUMBA_CACHE=str(cache_root))
    out = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE], env=env, cwd=PACKAGE_DIR.parent, capture_output=True, text=True, timeout=SUBPROCESS_SECONDS
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fresh_process_caches_kernels_under_the_digest_directory(tmp_path):
    cache_root = tmp_path / "numba-cache"
    first = probe_cache(cache_root)
    assert first["overloads"] == first["signatures"] >= 1  # compiled eagerly at import, by its signatures
    assert Path(first["cache_dir"]) == cache_root / first["digest"]
    cached = sorted(p.name for p in (cache_root / first["digest"]).rglob("*") if p.suffix in (".nbi", ".nbc"))
    assert any(n.endswith(".nbi") for n in cached) and any(n.endswith(".nbc") for n in cached), cached
    assert any("push_item" in n for n in cached), cached
    assert [p.name for p in cache_root.iterdir()] == [first["digest"]]
    # A second fresh process loads push_item from there instead of compiling it.
    second = probe_cache(cache_root)
    assert second["digest"] == first["digest"]
    assert second["hits"] >= 1 and second["misses"] == 0, second


# --- a forked child never compiles or loads a kernel ---------------------------------------


def all_dispatchers() -> list[Dispatcher]:
    found = []
    for module in (spsc, items, digest):
        for value in vars(module).values():
            if isinstance(value, Dispatcher) and value not in found:
                found.append(value)
    return found


def dispatcher_state() -> dict[str, tuple[int, int, int]]:
    return {
        d.py_func.__qualname__: (len(d.overloads), sum(d.stats.cache_misses.values()), sum(d.stats.cache_hits.values()))
        for d in all_dispatchers()
    }


def client_kernel_calls(buf: np.ndarray) -> dict[str, float]:
    """Call push_item, push_many and pop_many once each with the client's types; seconds per call."""
    tokens = np.arange(1, 9, dtype=np.uint32)
    flat = np.arange(1, 33, dtype=np.uint32)
    offsets = np.array([0, 8, 16, 32], np.int64)
    meta = np.zeros((1, L.META_WORDS), np.uint32)
    out = (np.empty(64, np.uint32), np.empty(9, np.int64), np.empty(8, np.uint64), np.empty((8, L.META_WORDS), np.uint32))
    seconds = {}
    started = time.perf_counter()
    rc = items.push_item(buf, tokens, 0, 16, items.NO_PREFIX, 0)
    seconds["push_item"] = time.perf_counter() - started
    assert rc in (L.OK, L.OK_WAKE), rc
    started = time.perf_counter()
    pushed, status, _ = spsc.push_many(buf, flat, offsets, 1, meta, 0, 3)
    seconds["push_many"] = time.perf_counter() - started
    assert (int(pushed), int(status)) == (3, L.OK)
    started = time.perf_counter()
    n, status, _ = spsc.pop_many(buf, *out, 8)
    seconds["pop_many"] = time.perf_counter() - started
    assert int(n) == 4 and out[2][:4].tolist() == [0, 1, 2, 3]
    return seconds


def child_calls_kernels(name: str):
    compiles = []
    original = Dispatcher._compile_for_args

    def tripwire(self, *args, **kws):
        compiles.append(self.py_func.__qualname__)
        return original(self, *args, **kws)

    Dispatcher._compile_for_args = tripwire
    seg = Segment.attach(name)
    try:
        before = dispatcher_state()
        seconds = client_kernel_calls(seg.buf)
        after = dispatcher_state()
        return before, after, compiles, seconds
    finally:
        Dispatcher._compile_for_args = original
        seg.close()


def test_forked_child_reuses_compiled_kernels(owner):
    owned = create_ring(owner, "x", 64 * 1024)
    # The parent runs the client's kernels once (compiling or loading them), then forks.
    client_kernel_calls(owned.segment.buf)
    parent_state = dispatcher_state()
    before, after, compiles, seconds = run_forked([(child_calls_kernels, owned.segment.name)])[0]
    assert compiles == []
    assert before == parent_state
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    for kernel_name, s in seconds.items():
        assert s < 0.05, f"{kernel_name} took {s * 1e3:.1f} ms in the child"
    with owned.attach(CONSUMER) as ring:
        assert ring.counters()["num_pushed"] == ring.counters()["num_popped"] == 8
    with owned.attach(PRODUCER) as ring:
        assert ring.next_key == 4


@pytest.mark.parametrize("relative", jit.NOT_KERNEL_SOURCES)
def test_reference_models_are_not_kernel_sources(tmp_path, relative):
    """The pure-Python reference models hold no kernels; editing one must not force a recompile."""
    assert "@kernel" not in (PACKAGE_DIR / relative).read_text()
    package, _ = stable_copy(tmp_path)
    base = load_jit_copy(package).sources_digest()
    path = package / relative
    path.write_text(path.read_text() + "\n# edited\n")
    assert load_jit_copy(package).sources_digest() == base
