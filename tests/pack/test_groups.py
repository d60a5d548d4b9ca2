"""The waiting groups' kernels against a plain-Python model of the same rule, on random traffic."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbroker.pack.groups import WaitingGroups


class Model:
    """Rows as a list; `take` by the module's rule, computed by counting."""

    def __init__(self):
        self.rows: list[tuple[int, int]] = []
        self.taken: list[bool] = []

    def append(self, key1, key2) -> int:
        first = len(self.rows)
        self.rows += list(zip(key1, key2))
        self.taken += [False] * len(key1)
        return first

    def members(self, level: int, key: int) -> list[int]:
        return [r for r, k in enumerate(self.rows) if not self.taken[r] and k[level] == key]

    def take(self, room: int, wait_limit: int) -> list[int]:
        out: list[int] = []
        while len(out) < room and not all(self.taken):
            head = self.taken.index(False)
            left = room - len(out)
            g1 = self.members(0, self.rows[head][0])
            if len(g1) <= left:
                pick = g1
            elif len(g1) <= wait_limit:
                break
            else:
                g2 = self.members(1, self.rows[head][1])
                if len(g2) <= left:
                    pick = g2
                elif len(g2) <= wait_limit:
                    break
                else:
                    pick = g2[:left]
            for r in pick:
                self.taken[r] = True
            out += pick
        return out


ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12)), min_size=1, max_size=40)),
    st.tuples(st.just("take"), st.tuples(st.integers(0, 30), st.integers(0, 12)))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_groups_follow_the_model(script):
    groups, model = WaitingGroups(), Model()
    for op, arg in script:
        if op == "append":
            k1 = np.array([a + 2 for a, _ in arg], np.uint64)  # 0 is read as 1 (a table's empty key)
            k2 = np.array([b * 7 + 1000 for _, b in arg], np.uint64)
            assert groups.append(k1, k2) == model.append(k1.tolist(), k2.tolist())
        else:
            room, limit = arg
            assert groups.take(room, limit).tolist() == model.take(room, limit)
        assert len(groups) == model.taken.count(False)
        assert groups.head == (model.taken.index(False) if False in model.taken else len(model.rows))


def test_growth_keeps_every_row_and_group():
    """Past its first size the ring and the group records double, mid-traffic, with rows taken out
    of order (holes) in the live span; the order of what is taken is the model's."""
    rng = np.random.default_rng(3)
    groups, model = WaitingGroups(), Model()
    for _ in range(40):
        n = int(rng.integers(100, 3000))
        k1 = rng.integers(2, 52, n).astype(np.uint64)
        k2 = rng.integers(0, 5000, n).astype(np.uint64) + 100
        groups.append(k1, k2)
        model.append(k1.tolist(), k2.tolist())
        room, limit = int(rng.integers(0, 2000)), int(rng.integers(0, 300))
        assert groups.take(room, limit).tolist() == model.take(room, limit)
    assert groups.S.taken.size > 1024
    rest = groups.take(10**9, 0)
    assert rest.tolist() == model.take(10**9, 0)
    assert len(groups) == 0 and groups.head == groups.tail


def test_a_group_enters_whole_when_it_fits():
    """Question-major: 200 documents' 5 questions each, 200 rows apart; room for 12 rows takes two
    documents whole, never a single question alone."""
    g = WaitingGroups()
    docs = np.tile(np.arange(200, dtype=np.uint64) + 1, 5)
    g.append(np.full(docs.size, 99, np.uint64), docs)  # one branch for all: the shared system prompt
    first = g.take(12, 8)
    assert sorted(docs[first].tolist()) == [1] * 5 + [2] * 5
    assert first.tolist() == [0, 200, 400, 600, 800, 1, 201, 401, 601, 801]
