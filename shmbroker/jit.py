"""numba's on-disk cache, keyed on every kernel source of the package.

numba keys a cached kernel on its own source file's timestamp only, so a
change to an imported helper (an atomics intrinsic, a layout constant) would
leave stale machine code in the cache. Every kernel of shmbroker is therefore
compiled with `kernel`, which points numba's cache at a directory named by a
hash of all kernel sources (`KERNEL_SOURCES`): change any of them and the next
process compiles afresh into a new directory. `prune_stale()` removes the
directories of older sources.

The cache root is `$SHMBROKER_NUMBA_CACHE`, else `$XDG_CACHE_HOME/shmbroker/numba`
(`~/.cache/shmbroker/numba`). A forked child inherits its parent's compiled
kernels and never loads or compiles them again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numba
from numba.core import config as numba_config

_PACKAGE_DIR = Path(__file__).resolve().parent

# Every file that holds a kernel or anything a kernel imports (intrinsics,
# layout constants). Globbed, so a new kernel module is covered by default.
KERNEL_SOURCES = ("jit.py", "ring/*.py", "pack/*.py", "spill/*.py", "workloads/trace.py",
                  "cluster/partition.py")
# Pure-Python reference models: no kernel imports them, so editing one needs no recompile.
NOT_KERNEL_SOURCES = ("ring/reference.py", "spill/model.py", "pack/reference.py", "pack/reference_index.py")


def _source_files() -> list[Path]:
    files: set[Path] = set()
    for pattern in KERNEL_SOURCES:
        files.update(_PACKAGE_DIR.glob(pattern))
    files.difference_update(_PACKAGE_DIR / name for name in NOT_KERNEL_SOURCES)
    return sorted(files)


def sources_digest() -> str:
    """Hex digest of every kernel source file (names and contents) plus numba's version."""
    h = hashlib.sha256(numba.__version__.encode())
    for path in _source_files():
        h.update(str(path.relative_to(_PACKAGE_DIR)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    explicit = os.environ.get("SHMBROKER_NUMBA_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shmbroker" / "numba"


CACHE_DIR = cache_root() / sources_digest()


def kernel(fn=None, *, signature=None, **options):
    """`numba.njit(cache=True, nogil=True)` with the cache directory keyed on all kernel sources.

    With `signature`, the kernel is compiled (or loaded from the cache) at
    import and never compiles again: a call with other argument types raises
    TypeError, which callers use as a free type check on their fast path.
    """

    def decorate(func):
        previous = numba_config.CACHE_DIR
        numba_config.CACHE_DIR = str(CACHE_DIR)
        try:
            if signature is None:
                return numba.njit(cache=True, nogil=True, **options)(func)
            return numba.njit(signature, cache=True, nogil=True, **options)(func)
        finally:
            numba_config.CACHE_DIR = previous

    if fn is None:
        return decorate
    return decorate(fn)


VERSION_FILE = "numba-version"  # in each cache directory: the numba that filled it


def prune_stale() -> list[Path]:
    """Remove cache directories of kernel sources other than the current ones, compiled by this
    numba (another environment's numba, e.g. `.venv-vllm`'s, keeps its own); marks the current one."""
    removed = []
    root = cache_root()
    if not root.is_dir():
        return removed
    if CACHE_DIR.is_dir():
        (CACHE_DIR / VERSION_FILE).write_text(numba.__version__)
    for child in root.iterdir():
        if not child.is_dir() or child == CACHE_DIR:
            continue
        marker = child / VERSION_FILE
        if marker.is_file() and marker.read_text().strip() != numba.__version__:
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed
