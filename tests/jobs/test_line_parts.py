"""`jobs/parts.py`: the vectors of a line of several inputs, held durably until its last came.

A line completes once each part came (a part held twice counts once); the file survives a reopen
(a killed run), which finds what is still waiting, drops what was written, and sees a line whose
every vector was held before its line was written; a torn or damaged tail is cut, never read."""

from __future__ import annotations

import numpy as np

from shmbroker.jobs.parts import FILE_NAME, LineParts


def vec(seed: int, n: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_a_line_completes_with_its_last_part_in_order_and_bit_exact(tmp_path):
    parts = LineParts(tmp_path / FILE_NAME)
    assert parts.add("k", 2, 3, vec(2), 5) is None
    assert parts.add("k", 2, 3, vec(99), 5) is None  # held already: ignored
    assert parts.add("k", 0, 3, vec(0), 7) is None and parts.holds("k", 0) and not parts.holds("k", 1)
    vectors, tokens = parts.add("k", 1, 3, vec(1, 1000), 11)
    assert tokens == 23 and [v.size for v in vectors] == [24, 1000, 24]
    for k, v in enumerate(vectors):
        assert np.array_equal(v.view(np.uint32), vec(k, v.size).view(np.uint32))
    assert parts.waiting() == 0
    parts.close()
    assert not (tmp_path / FILE_NAME).exists()  # nothing waits: removed


def test_a_reopened_file_holds_what_waits_and_drops_what_was_written(tmp_path):
    path = tmp_path / FILE_NAME
    parts = LineParts(path)
    parts.add("a", 0, 2, vec(10), 3)
    parts.add("b", 0, 2, vec(20), 4)
    parts.add("c", 0, 2, vec(30), 5)
    assert parts.add("c", 1, 2, vec(31), 6) is not None  # whole: to be written; the run dies before it is
    parts.sync()
    again = LineParts(path, written={"b"})  # a killed run's file, opened by the next run
    assert again.holds("a", 0) and not again.holds("b", 0)
    assert again.whole() == ["c"]  # its every vector held: the next run writes it (jobsink.write_whole)
    vectors, tokens = again.take("c")
    assert tokens == 11 and np.array_equal(vectors[1], vec(31))
    got = again.add("a", 1, 2, vec(11), 9)
    assert got is not None and got[1] == 12 and np.array_equal(got[0][0], vec(10))
    assert again.waiting() == 0


def test_a_torn_or_damaged_tail_is_cut(tmp_path):
    path = tmp_path / FILE_NAME
    parts = LineParts(path)
    parts.add("x", 0, 3, vec(1), 1)
    parts.add("y", 0, 3, vec(2), 1)
    parts.sync()
    size = path.stat().st_size
    with open(path, "r+b") as fh:  # damage the second record's vector
        fh.seek(size - 16)
        fh.write(b"\xff" * 4)
    with open(path, "ab") as fh:  # and a torn record after it
        fh.write(b"SMBP\x00\x01")
    again = LineParts(path)
    assert again.holds("x", 0) and not again.holds("y", 0)
    assert path.stat().st_size < size  # cut at the damaged record
