"""A pure-Python reference model of the packer, for one consumer, without aging.

The packer (`packer.py`, `policy.py`, `select.py`, `index.py`) is numba kernels over record arrays,
linked lists threaded through slots and bitmaps. This module says what those kernels compute in
plain Python (dicts and lists, no slots, no bitmaps), so a test can feed both the same calls and
compare every batch (`tests/test_pack_reference.py`).

What it models, exactly (the batch sequence: keys in order, failed keys in order, the shape's
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
  under its deepest existing ancestor among its block hashes (else under its branch) when absent;
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

from dataclasses import dataclass, field

from .contract import Contract

FAILED_MAX = 64  # failures collected per decision
CANDIDATES_PER_SLOT = 4  # padded: candidates a decision chooses from, per max_batch_size
BAND_SUB_BITS = 8  # 256 bands per octave above 256 tokens, exact below
BAND_SUB = 1 << BAND_SUB_BITS
LENGTH_BITS = 24
NUM_BANDS = BAND_SUB + (LENGTH_BITS - BAND_SUB_BITS) * BAND_SUB
TOP_BAND = NUM_BANDS - 1
DEFAULT_TOLERANCE = 1 / 16
BRANCH_CLAIM_ORDER = ("affine", "overflow", "fits")
FAMILY_TAKE_ORDER = ("overflow", "fits")


def band_of(n: int) -> int:
    """Length band of n tokens: n itself below 256, then 256 bands per octave."""
    if n < BAND_SUB:
        return n
    e = n.bit_length() - 1
    sub = (n >> (e - BAND_SUB_BITS)) & (BAND_SUB - 1)
    return (e - BAND_SUB_BITS + 1) * BAND_SUB + sub


def band_floor(band: int) -> int:
    """The shortest length in `band`."""
    if band < BAND_SUB:
        return band
    e = band // BAND_SUB + BAND_SUB_BITS - 1
    return (BAND_SUB + band % BAND_SUB) << (e - BAND_SUB_BITS)


def hint_slots(capacity: int) -> int:
    """Slots of the index's branch hint table for an item capacity."""
    return 1 << max(16, (2 * capacity - 1).bit_length())


@dataclass(eq=False)
class _Item:
    key: int
    length: int
    family: _Family
    node: _Node | None = None
    max_new: int = 1


@dataclass(eq=False)
class _Node:
    key: int  # block hash (the family key for a root)
    parent: _Node | None
    depth: int  # 0: the family root, 1: a branch
    family: _Family
    items: list = field(default_factory=list)  # items ending here, in insert order
    children: list = field(default_factory=list)  # live children, in the order they became live
    # branches only
    maxlen: int = 0  # longest item ever inserted under it while it lived
    maxnew: int = 0  # largest max_new ever inserted under it while it lived
    claimed: bool = False
    affine: bool = False  # created while the hint table held its key: the consumer drained it before
    listed: str | None = None  # the family's branch list it is in


@dataclass(eq=False)
class _Family:
    key: int
    model: int
    bands: dict = field(default_factory=dict)  # band -> [items], oldest insert first; no empty lists
    root: _Node | None = None
    claimed: bool = False
    listed: str | None = None  # the family list it is in
    maxnew: int = 0  # largest max_new ever inserted while it lived
    branch_lists: dict = field(default_factory=lambda: {name: [] for name in BRANCH_CLAIM_ORDER})

    @property
    def pending(self) -> int:
        return sum(len(items) for items in self.bands.values())


@dataclass(frozen=True)
class RefBatch:
    """A decision of the model: keys taken (in batch order), keys failed back (in order), shape."""

    keys: tuple
    failed: tuple
    family: int
    length_min: int
    length_max: int


def _move(lists: dict, member, name: str | None) -> None:
    """Move `member` to the tail of lists[name] (None: out of every list); no-op when already there."""
    if member.listed == name:
        return
    if member.listed is not None:
        lists[member.listed].remove(member)
    member.listed = name
    if name is not None:
        lists[name].append(member)


class ReferencePacker:
    """The packer's decisions for one consumer (`contract`, `mode`), without aging. See the module doc."""

    def __init__(self, contract: Contract, mode: str, *, capacity: int, tolerance: float = DEFAULT_TOLERANCE):
        if mode not in ("padded", "packed"):
            raise ValueError(f"mode must be 'padded' or 'packed', got {mode!r}")
        self.contract = contract
        self.mode = mode
        self.tol = float(tolerance)
        self.hint_slots = hint_slots(capacity)
        self.families: dict[int, _Family] = {}  # family key -> family with items
        self.family_lists = {name: [] for name in FAMILY_TAKE_ORDER}
        self.nodes: dict[int, _Node] = {}  # block hash -> live non-root node, every family
        self.hints: dict[int, int] = {}  # slot -> branch key the consumer drained last there
        self.num_items = 0
        # the consumer
        self.family: _Family | None = None  # held until it has no items
        self.band = TOP_BAND  # padded: the sweep's cursor
        self.branch: _Node | None = None  # packed: the branch being drained

    def __len__(self) -> int:
        return self.num_items

    # ---- the index ----------------------------------------------------------------------------

    def add(self, key: int, length: int, family: int, hashes, model: int = 0, max_new: int = 1) -> None:
        """Index one item: its family key and block hashes as `shape_items` gives them."""
        hashes = [int(h) for h in hashes]
        fam = self.families.get(family)
        if fam is None:
            fam = self.families[family] = _Family(family, model)
        item = _Item(key, length, fam, max_new=max_new)
        fam.maxnew = max(fam.maxnew, max_new)
        if fam.root is None:
            fam.root = _Node(family, None, 0, fam)
        node = fam.root
        if hashes:
            node = self.nodes.get(hashes[0]) or self._new_node(hashes[0], fam.root, 1, fam)
        if len(hashes) >= 2:
            last = len(hashes) - 1
            end = self.nodes.get(hashes[last])
            if end is None:
                parent = node  # the branch, unless a deeper ancestor has a node
                for d in range(last - 1, 0, -1):
                    if hashes[d] in self.nodes:
                        parent = self.nodes[hashes[d]]
                        break
                end = self._new_node(hashes[last], parent, last + 1, fam)
            node = end
        node.items.append(item)
        item.node = node
        branch = self._branch_of(node)
        if branch is not None:
            branch.maxlen = max(branch.maxlen, length)
            branch.maxnew = max(branch.maxnew, max_new)
            self._relist_branch(branch)
        fam.bands.setdefault(band_of(length), []).append(item)
        self.num_items += 1
        self._relist_family(fam)

    def _new_node(self, key: int, parent: _Node, depth: int, fam: _Family) -> _Node:
        """A node gets an item or a child in the insert that creates it: it is live at once."""
        node = _Node(key, parent, depth, fam)
        if depth == 1:
            node.affine = self.hints.get(key % self.hint_slots) == key
        parent.children.append(node)
        self.nodes[key] = node
        return node

    @staticmethod
    def _branch_of(node: _Node) -> _Node | None:
        while node.depth > 1:
            node = node.parent
        return node if node.depth == 1 else None

    def _relist_branch(self, branch: _Node) -> None:
        name = None
        if not branch.claimed and (branch.items or branch.children):
            fits = branch.maxlen <= self.contract.max_input_len
            name = "affine" if branch.affine and fits else ("fits" if fits else "overflow")
        _move(branch.family.branch_lists, branch, name)

    def _relist_family(self, fam: _Family) -> None:
        name = None
        if not fam.claimed and fam.bands and fam.model == self.contract.model:
            name = "fits" if band_floor(min(fam.bands)) <= self.contract.max_input_len else "overflow"
        _move(self.family_lists, fam, name)

    def _remove(self, item: _Item) -> None:
        fam = item.family
        band = fam.bands[band_of(item.length)]
        band.remove(item)
        if not band:
            del fam.bands[band_of(item.length)]
        node = item.node
        node.items.remove(item)
        while node is not None and not node.items and not node.children:  # the node dies
            parent = node.parent
            if parent is not None:
                parent.children.remove(node)
                del self.nodes[node.key]
            else:
                fam.root = None
            if node.depth == 1:
                _move(fam.branch_lists, node, None)
                if node.claimed or node.affine:  # the consumer served it: remember for its next turn
                    self.hints[node.key % self.hint_slots] = node.key
                if self.branch is node:
                    self.branch = None
            node = parent
        self.num_items -= 1
        if not fam.bands:
            _move(self.family_lists, fam, None)
            del self.families[fam.key]
            if self.family is fam:
                self.family = None
        else:
            self._relist_family(fam)

    # ---- decisions ----------------------------------------------------------------------------

    def next_batch(self) -> RefBatch | None:
        """The consumer's next batch (its items and failures leave the model), or None."""
        if self.family is None:
            for name in FAMILY_TAKE_ORDER:
                if self.family_lists[name]:
                    self.family = self.family_lists[name][0]
                    scan = self.contract.max_batch_size if self.mode == "packed" else 1
                    for other in self.family_lists[name][:scan]:
                        if self._steps(other) > self._steps(self.family):
                            self.family = other
                    break
            else:
                return None
            self.family.claimed = True
            _move(self.family_lists, self.family, None)
            self.band = TOP_BAND
        fam = self.family
        if self.mode == "padded":
            taken, failed = self._select_padded(fam)
            lengths = [item.length for item in taken]
            bounds = (min(lengths), max(lengths)) if taken else (0, 0)
        else:
            taken, failed = self._select_packed(fam)
            bounds = (1, self.contract.max_input_len)
        assert taken or failed, "one consumer: a family with items always gives a batch"
        for item in taken + failed:
            self._remove(item)
        return RefBatch(tuple(i.key for i in taken), tuple(i.key for i in failed), fam.key, *bounds)

    def _steps(self, fam: _Family) -> int:
        items = [i for band in fam.bands.values() for i in band]
        return max(fam.maxnew, sum(i.length for i in items) // self.contract.max_batch_tokens,
                   sum(i.max_new for i in items) // self.contract.max_batch_size)

    def _select_padded(self, fam: _Family) -> tuple[list, list]:
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

    def _select_packed(self, fam: _Family) -> tuple[list, list]:
        con = self.contract
        taken: list = []
        failed: list = []

        def take(item: _Item) -> bool:
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

    def _claim_branch(self, fam: _Family) -> _Node | None:
        for name in BRANCH_CLAIM_ORDER:
            if fam.branch_lists[name]:
                branch = fam.branch_lists[name][0]
                if name != "affine":  # the longest generation of the first max_batch_size
                    for other in fam.branch_lists[name][:self.contract.max_batch_size]:
                        if other.maxnew > branch.maxnew:
                            branch = other
                _move(fam.branch_lists, branch, None)
                branch.claimed = True
                return branch
        return None


def _depth_first(node: _Node):
    """Items of node's subtree: the node's own, then each live child's subtree in order."""
    yield from node.items
    for child in node.children:
        yield from _depth_first(child)
