"""A pure-Python reference model of the packer, for one consumer, without aging.

The packer (`packer.py`, `policy.py`, `sweep.py`, `branches.py`, `index.py`) is numba kernels over record arrays,
linked lists threaded through slots and bitmaps. This module says what those kernels compute in
plain Python (dicts and lists, no slots, no bitmaps), so a test can feed both the same calls and
compare every batch (`tests/pack/test_pack_reference.py`). Its index (families, trie, lists) is
`reference_index.py`; this module is its decisions.

What it models, exactly (the batch sequence: handles in order, failed handles in order, the shape's
family and length bounds), for a `Packer([ConsumerSpec(name, contract, mode)], max_wait_seconds=None,
tolerance=tol)`:

- **One consumer**, so it is the largest of its model: items longer than its `max_input_len` are
  failed back ("too_long"), at most `FAILED_MAX` a decision, when a walk meets them.
- **Families.** A family is listed while nobody holds it: in the "overflow" list when its lowest
  non-empty band starts above `max_input_len` (`band_floor`, so at band resolution), else in the
  "fits" list. Listing appends at the tail; a family re-listed into the list it is in keeps its
  place. A family created again after it drained is a new family (at the tail).
- **Stickiness.** The consumer takes, of the first `max_batch_size` families (packed; padded: the
  first) of "overflow", else of "fits", the one of the most steps (the first among equals): the
  largest of the max_new ever inserted in it while it lived, its pending tokens //
  max_batch_tokens and its pending max_new summed // max_batch_size; and keeps that family until
  it has no items left. (With one consumer and no aging a select never comes back empty from a
  family with items, so the packer's other tries, `FAMILY_ATTEMPTS`, never happen; the model
  asserts this.)
- **padded**: a descending sweep of the family's bands from a cursor (the band where the previous
  batch stopped; the top when the family was just taken or the last sweep ran off the bottom).
  Pass 1 visits the non-empty bands at or below the cursor, top down; pass 2, only when pass 1
  found nothing and the cursor is not the top, those above it. Within a band items come oldest
  insert first. An item is failed (when it is too long), else it is a candidate, until the walk
  stops: at the `FAILED_MAX`+1-th failure, at the first item that would break longest <= (1 + tol)
  x shortest among the candidates, or once it holds `CANDIDATES_PER_SLOT` x max_batch_size
  candidates. The batch takes the candidates longest max_new first (walk order among equals),
  stopping at the first that would break count <= max_batch_size or count x longest <=
  max_batch_tokens. A generating family (tol > 0 and the largest max_new ever inserted in it while
  it lived > 1) whose candidates could not fill the rectangle (fewer than max_batch_size, and one
  more of the longest's length would fit max_batch_tokens) is walked again, from the same cursor,
  without the tolerance cut (its failures collected again); then, for each cap on input length, from the shortest
  candidate's length up, the next being the larger of (1 + tol) x the cap (truncated) and the
  shortest candidate length above it, the batch would be the candidates of length <= cap taken
  longest max_new first, skipping (not stopping at) those that would break count or count x
  longest; the cap whose batch has the largest sum of max(1, max_new) over its first item's
  max(1, max_new) wins (the smallest among equals), and that is the batch. The cursor: the band
  of the first candidate in walk order not taken, else the band where the walk stopped, else (it ran off the bottom) the top. Shape bounds: (shortest,
  longest) of the items taken, (0, 0) for a batch of failures only.
- **padded, loose** (`loose.py`): before the sweep, a family that generates (tol > 0 and its
  largest max_new ever > 1) is weighed (`pays`): it pays for a rectangle of its own when it has at
  least 2 items, a base > 0 (the largest inserted while it lived), at least as many items as rows =
  min(max_batch_size, max(1, max_batch_tokens x pending // its pending tokens)), and (rows - 1) x
  base >= step_tokens x (its largest max_new ever - its pending max_new summed / pending). When it
  does not, the batch is loose: of the classes "overflow" then "fits" (the consumer's model; the
  item's own length says which), the first with an item of output band >= 1 (`out_band`); its
  highest such output band, then each lower one >= 1, each walked band by band from the top (the
  first) or from the band of max_batch_tokens // (count + 1) (the others) down, within a band
  oldest insert first. An item longer than max_input_len is failed (the `FAILED_MAX`+1-th ends the
  walk); the walk ends once count == max_batch_size or (count + 1) x longest > max_batch_tokens;
  an item whose family pays, or whose (count + 1) x length > max_batch_tokens, is passed over (the
  SKIP_PER_SLOT x max_batch_size-th ends the walk). A loose
  batch with anything in it lets the family go (relisted, the cursor to the top at the next take)
  and has family 0; one with nothing falls through to the sweep.
- **packed**: the family root's own items (items of no block past the family key) first, then the
  claimed branch (a depth-1 trie node: the first block hash after the family key) depth-first:
  a node's items in insert order, then its live children in the order they became live. When a
  branch is walked to its end the next one is claimed (before its first item is tried, so a batch
  may stop holding a branch it took nothing from yet): the head of the consumer's "affine" list
  (branches re-created after it drained one of that key), else of the first `max_batch_size` of
  "overflow" (branches whose longest item is too long), else of "fits", the one with the largest
  max_new ever inserted under it while it lived (the first among equals); branch lists keep
  append order like family lists, and a branch
  moves list (to the tail) when its longest item grows past `max_input_len`. The batch (an ordered
  group: no count x longest bound) stops at the first item past count, or at the `FAILED_MAX`+1-th failure; a
  branch left part-way stays claimed for the next decision. Shape bounds: (1, max_input_len).
- **The trie** is path-compressed as in the index: an item's node is its last block hash, created
  under its deepest existing ancestor among its block hashes (else under its branch) when absent,
  with a node for its deep block (`shapes.deep_block`) between them when that ancestor is above it;
  a node dies (leaves its parent's children and every list) when it has no items and no children.
  A branch that dies records the consumer in a direct-mapped hint table of `hint_slots(capacity)`
  slots indexed by the key's low bits (a later key with the same low bits overwrites it); a
  branch created while its key is in the table is affine to the consumer (in the "affine" list
  while its longest item fits).
- A batch's taken items are removed first, then its failures, in their order.
- Items of another model than the consumer's are kept and never served or failed (the packer has
  no consumer for them).

What it does not model: several consumers (ascending sweeps, shared families, other consumers'
affine lists, smaller consumers turning back from longer items, parts of another's branch taken
over), aging (`max_wait_seconds`, the
age queues, `overdue_alone`), guard refusals and `unclaim` (the model assumes every batch passes),
and the index's capacity limits (`IndexFull`). Block hashes are taken as given (`shapes.py` makes
them); a family key colliding with a block hash is assumed not to happen.
"""


from __future__ import annotations

from dataclasses import dataclass

from .contract import Contract, Mode, as_mode
from .reference_index import (
    BRANCH_CLAIM_ORDER,
    FAMILY_TAKE_ORDER,
    LENGTH_MAX,
    TOP_BAND,
    band_of,
    out_band,
    ReferenceIndex,
    RefFamily,
    RefItem,
    RefNode,
    move_to,
)

FAILED_MAX = 64  # failures collected per decision
CANDIDATES_PER_SLOT = 4  # padded: candidates a decision chooses from, per max_batch_size
SKIP_PER_SLOT = 4  # padded, loose: items of paying families passed over per max_batch_size
DEFAULT_TOLERANCE = 1 / 16
DEFAULT_STEP_TOKENS = 1600.0


@dataclass(frozen=True)
class RefBatch:
    """A decision of the model: handles taken (in batch order), handles failed back (in order), shape."""

    handles: tuple
    failed: tuple
    family: int
    length_min: int
    length_max: int


class ReferencePacker(ReferenceIndex):
    """The packer's decisions for one consumer (`contract`, `mode`), without aging. See the module doc."""

    def __init__(self, contract: Contract, mode: Mode, *, capacity: int, tolerance: float = DEFAULT_TOLERANCE,
                 step_tokens: float = DEFAULT_STEP_TOKENS):
        mode = as_mode(mode)
        super().__init__(contract, capacity=capacity)
        self.mode = mode
        self.tol = float(tolerance)
        self.step_tokens = float(step_tokens)
        self.band = TOP_BAND  # padded: the sweep's cursor

    def next_batch(self) -> RefBatch | None:
        """The consumer's next batch (its items and failures leave the model), or None."""
        if self.family is None:
            for name in FAMILY_TAKE_ORDER:
                if self.family_lists[name]:
                    self.family = self.family_lists[name][0]
                    scan = self.contract.max_batch_size if self.mode == Mode.PACKED else 1
                    for other in self.family_lists[name][:scan]:
                        if self._steps(other) > self._steps(self.family):
                            self.family = other
                    break
            else:
                return None
            self.family.claimed = True
            move_to(self.family_lists, self.family, None)
            self.band = TOP_BAND
        fam = self.family
        if self.mode == Mode.PADDED and self.tol > 0 and fam.maxnew > 1 and not self._pays(fam):
            taken, failed = self._select_loose()
            if taken or failed:
                fam.claimed = False
                self.family = None
                self._relist_family(fam)
                for item in taken + failed:
                    self._remove(item)
                lengths = [item.length for item in taken]
                bounds = (min(lengths), max(lengths)) if taken else (0, 0)
                return RefBatch(tuple(i.handle for i in taken), tuple(i.handle for i in failed), 0, *bounds)
        if self.mode == Mode.PADDED:
            taken, failed = self._select_padded(fam)
            lengths = [item.length for item in taken]
            bounds = (min(lengths), max(lengths)) if taken else (0, 0)
        else:
            taken, failed = self._select_packed(fam)
            bounds = (1, self.contract.max_input_len)
        assert taken or failed, "one consumer: a family with items always gives a batch"
        for item in taken + failed:
            self._remove(item)
        return RefBatch(tuple(i.handle for i in taken), tuple(i.handle for i in failed), fam.key, *bounds)

    def _steps(self, fam: RefFamily) -> int:
        items = [i for band in fam.bands.values() for i in band]
        return max(fam.maxnew, sum(i.length for i in items) // self.contract.max_batch_tokens,
                   sum(i.max_new for i in items) // self.contract.max_batch_size)

    def _pays(self, fam: RefFamily) -> bool:
        con = self.contract
        items = fam.items()
        pending = len(items)
        if pending < 2 or fam.base == 0:
            return False
        rows = min(con.max_batch_size, max(1, con.max_batch_tokens * pending // max(sum(i.length for i in items), 1)))
        if pending < rows:
            return False
        spread = fam.maxnew - sum(i.max_new for i in items) / pending
        return (rows - 1) * float(fam.base) >= self.step_tokens * spread

    def _select_loose(self) -> tuple[list, list]:
        con = self.contract
        mine = [i for fam in self.families.values() if fam.model == con.model for i in fam.items()
                if out_band(i.max_new) >= 1]
        taken: list = []
        failed: list = []
        for overflow in (True, False):
            lanes = [i for i in mine if (i.length > con.max_input_len) == overflow]
            if lanes:
                break
        else:
            return taken, failed
        skips = SKIP_PER_SLOT * con.max_batch_size
        pays = {}
        for o in sorted({out_band(i.max_new) for i in lanes}, reverse=True):
            if len(taken) >= con.max_batch_size:
                break
            hi = max((i.length for i in taken), default=0)
            top = band_of(min(con.max_batch_tokens // (len(taken) + 1), LENGTH_MAX)) if taken else TOP_BAND
            lane = sorted((i for i in lanes if out_band(i.max_new) == o and band_of(i.length) <= top),
                          key=lambda i: (-band_of(i.length), i.seq))
            for item in lane:
                if item.length > con.max_input_len:
                    if len(failed) == FAILED_MAX:
                        return taken, failed
                    failed.append(item)
                    continue
                if item.family not in pays:
                    pays[item.family] = self._pays(item.family)
                if pays[item.family]:
                    skips -= 1
                    if skips == 0:
                        return taken, failed
                    continue
                count = len(taken) + 1
                if count > con.max_batch_size or count * hi > con.max_batch_tokens:
                    return taken, failed
                if count * item.length > con.max_batch_tokens:  # longer than a next row may be
                    skips -= 1
                    if skips == 0:
                        return taken, failed
                    continue
                taken.append(item)
                hi = max(hi, item.length)
        return taken, failed

    def _select_padded(self, fam: RefFamily) -> tuple[list, list]:
        con = self.contract
        generating = False  # widened: a generating family's band that cannot fill the rectangle
        start = self.band
        below = [b for b in sorted(fam.bands, reverse=True) if b <= start]
        above = [b for b in sorted(fam.bands, reverse=True) if b > start]
        cands: list = []  # (band, item) in walk order
        failed: list = []
        stop = None  # the band where the walk stopped; None: it ran off the bottom

        def walk() -> bool:
            """Collect from below, then above; False once the walk stops."""
            nonlocal stop
            for sweep in (below, above):
                if sweep is above and (cands or start == TOP_BAND):
                    return True
                for band in sweep:
                    for item in fam.bands[band]:
                        if item.length > con.max_input_len:
                            if len(failed) == FAILED_MAX:
                                stop = band
                                return False
                            failed.append(item)
                            continue
                        lengths = [i.length for _, i in cands] + [item.length]
                        if len(cands) == CANDIDATES_PER_SLOT * con.max_batch_size \
                                or (not generating and max(lengths) > min(lengths) * (1.0 + self.tol)):
                            stop = band
                            return False
                        cands.append((band, item))
            return True

        walk()
        if self.tol > 0 and fam.maxnew > 1 and len(cands) < con.max_batch_size and \
                (len(cands) + 1) * max([i.length for _, i in cands], default=0) <= con.max_batch_tokens:
            generating = True
            cands.clear()
            failed.clear()
            stop = None
            walk()
        order = sorted(range(len(cands)), key=lambda i: (-cands[i][1].max_new, i))

        def fill(cap: float) -> list:
            """Indices taken, longest max_new first, of the candidates of length <= cap; a generating
            batch skips those that do not fit, a prefill batch stops at the first."""
            got: list = []
            for i in order:
                item = cands[i][1]
                count = len(got) + 1
                if item.length > cap or count > con.max_batch_size or count * max(
                        [cands[t][1].length for t in got] + [item.length]) > con.max_batch_tokens:
                    if generating:
                        continue
                    break
                got.append(i)
            return got

        cap = float("inf")
        if generating and cands:
            lengths = sorted({item.length for _, item in cands})
            c = lengths[0]
            best, most = c, -1.0
            while True:
                got = fill(c)
                steps = [max(1, cands[i][1].max_new) for i in got]
                if got and sum(steps) / steps[0] > most:
                    best, most = c, sum(steps) / steps[0]
                above = [n for n in lengths if n > c]
                if not above:
                    break
                c = max(above[0], int(c * (1.0 + self.tol)))
            cap = best
        chosen = fill(cap)
        taken = [cands[i][1] for i in chosen]
        left = [band for i, (band, _) in enumerate(cands) if i not in chosen]
        self.band = left[0] if left else (TOP_BAND if stop is None else stop)
        return taken, failed

    def _select_packed(self, fam: RefFamily) -> tuple[list, list]:
        con = self.contract
        taken: list = []
        failed: list = []

        def take(item: RefItem) -> bool:
            """Take or fail item; False when the batch stops before it."""
            if item.length > con.max_input_len:
                if len(failed) == FAILED_MAX:
                    return False
                failed.append(item)
                return True
            if len(taken) + 1 > con.max_batch_size:
                return False
            taken.append(item)
            return True

        for item in fam.root.items:
            if not take(item):
                return taken, failed
        while True:
            if self.branch is None:
                self.branch = self._claim_branch(fam)
                if self.branch is None:
                    return taken, failed
            assert self.branch.family is fam, "one consumer: its branch is in its family"
            for item in _depth_first(self.branch):
                if not take(item):
                    return taken, failed
            self.branch = None  # wholly in this batch: it dies when the batch's items leave

    def _claim_branch(self, fam: RefFamily) -> RefNode | None:
        for name in BRANCH_CLAIM_ORDER:
            if fam.branch_lists[name]:
                branch = fam.branch_lists[name][0]
                if name != "affine":  # the longest generation of the first max_batch_size
                    for other in fam.branch_lists[name][:self.contract.max_batch_size]:
                        if other.maxnew > branch.maxnew:
                            branch = other
                move_to(fam.branch_lists, branch, None)
                branch.claimed = True
                return branch
        return None


def _depth_first(node: RefNode):
    """Items of node's subtree: the node's own, then each live child's subtree in order."""
    yield from node.items
    for child in node.children:
        yield from _depth_first(child)
