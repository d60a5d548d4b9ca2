"""A seqlock over a run of int64 words: one writer publishes them together, readers copy them without locks.

A process keeps its counters in a private array and publishes them into its slot of the control
segment (`control/segment.py`) with `publish`; `shmbroker top`, `status` and the Prometheus exporter copy
them with `read`. A reader never sees a torn set: a pair of counters (padded and rectangle tokens,
hit and queried blocks) always comes from one publication, so a ratio of two never mixes moments.

Layout (int64 words of `words`)

| word          | field    | meaning                                                              |
|---------------|----------|----------------------------------------------------------------------|
| seq_at        | sequence | even: stable; odd: a publication is under way; +2 per publication     |
| at .. at+n-1  | values   | the published words                                                  |

Writer: sequence = odd (relaxed), release fence, the values, then sequence = even by a release
store. Reader: sequence (acquire) even, copy the values, acquire fence, sequence again equal: the
copy is one publication; otherwise retry, at most `max_tries` times (a writer stalled mid-publication
for that long makes `read` return False and the caller keeps its last copy).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .atomics import cpu_pause, fence_acquire, fence_release, load_acquire, load_relaxed, store_release


@kernel(_nrt=False)
def publish(words, seq_at, at, values):
    """Publish values[:] into words[at : at + values.size] under the sequence word words[seq_at]."""
    seq = load_relaxed(words, seq_at)
    if seq & 1:  # a writer killed mid-publication: this incarnation starts a fresh even count
        seq += 1
    store_release(words, seq_at, seq + 1)
    fence_release()
    for i in range(values.size):
        words[at + i] = values[i]
    store_release(words, seq_at, seq + 2)


@kernel(_nrt=False)
def read(words, seq_at, at, out, max_tries):
    """Copy one publication of words[at : at + out.size] into out; False after max_tries torn attempts."""
    for _ in range(max_tries):
        before = load_acquire(words, seq_at)
        if before & 1:
            cpu_pause()
            continue
        for i in range(out.size):
            out[i] = load_relaxed(words, at + i)
        fence_acquire()
        if load_relaxed(words, seq_at) == before:
            return True
        cpu_pause()
    return False


def warm() -> None:
    """Compile (or load) both kernels for the arrays the broker passes: writable and read-only views."""
    words = np.zeros(8, np.int64)
    values = np.arange(4, dtype=np.int64)
    publish(words, 0, 1, values)
    out = np.empty(4, np.int64)
    read(words, 0, 1, out, 4)
    ro = words.view()
    ro.flags.writeable = False
    read(ro, 0, 1, out, 4)
