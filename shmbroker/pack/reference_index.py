"""The reference packer's index, in plain Python: families, the trie, their lists, the hint table.

What the model of `reference.py` decides from (see its module doc for the rules it models: the
lists' order, the path-compressed trie, the hint table). No slots and no bitmaps: dicts and
lists, so a test can compare the kernels' batches with what this says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .contract import Contract
from .shapes import deep_block

BAND_SUB_BITS = 8  # 256 bands per octave above 256 tokens, exact below
BAND_SUB = 1 << BAND_SUB_BITS
LENGTH_BITS = 24
NUM_BANDS = BAND_SUB + (LENGTH_BITS - BAND_SUB_BITS) * BAND_SUB
TOP_BAND = NUM_BANDS - 1
LENGTH_MAX = (1 << LENGTH_BITS) - 1
BRANCH_CLAIM_ORDER = ("affine", "overflow", "fits")
FAMILY_TAKE_ORDER = ("overflow", "fits")


def band_of(n: int) -> int:
    """Length band of n tokens: n itself below 256, then 256 bands per octave."""
    if n < BAND_SUB:
        return n
    e = n.bit_length() - 1
    sub = (n >> (e - BAND_SUB_BITS)) & (BAND_SUB - 1)
    return (e - BAND_SUB_BITS + 1) * BAND_SUB + sub


def out_band(max_new: int) -> int:
    """Output band: 0 for at most one token, else two per octave of max_new."""
    if max_new <= 1:
        return 0
    e = max_new.bit_length() - 1
    return 1 + 2 * e + ((max_new >> (e - 1)) & 1)


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
class RefItem:
    handle: int
    length: int
    family: RefFamily
    node: RefNode | None = None
    max_new: int = 1
    seq: int = 0  # insert order: its place in its lane's band (`lanes.py`)


@dataclass(eq=False)
class RefNode:
    key: int  # block hash (the family key for a root)
    parent: RefNode | None
    depth: int  # 0: the family root, 1: a branch
    family: RefFamily
    items: list = field(default_factory=list)  # items ending here, in insert order
    children: list = field(default_factory=list)  # live children, in the order they became live
    # branches only
    maxlen: int = 0  # longest item ever inserted under it while it lived
    maxnew: int = 0  # largest max_new ever inserted under it while it lived
    claimed: bool = False
    affine: bool = False  # created while the hint table held its key: the consumer drained it before
    listed: str | None = None  # the family's branch list it is in


@dataclass(eq=False)
class RefFamily:
    key: int
    model: int
    bands: dict = field(default_factory=dict)  # band -> [items], oldest insert first; no empty lists
    root: RefNode | None = None
    claimed: bool = False
    listed: str | None = None  # the family list it is in
    maxnew: int = 0  # largest max_new ever inserted while it lived
    base: int = 0  # the largest base (tokens under the family key) inserted while it lived
    branch_lists: dict = field(default_factory=lambda: {name: [] for name in BRANCH_CLAIM_ORDER})

    @property
    def pending(self) -> int:
        return sum(len(items) for items in self.bands.values())

    def items(self) -> list:
        return [i for band in self.bands.values() for i in band]


def move_to(lists: dict, member, name: str | None) -> None:
    """Move `member` to the tail of lists[name] (None: out of every list); no-op when already there."""
    if member.listed == name:
        return
    if member.listed is not None:
        lists[member.listed].remove(member)
    member.listed = name
    if name is not None:
        lists[name].append(member)


class ReferenceIndex:
    """The model's index for one consumer (`contract`): families, trie, lists, hints; and what the
    consumer holds (its family, its branch), which a removal lets go of when it dies."""

    def __init__(self, contract: Contract, *, capacity: int):
        self.contract = contract
        self.hint_slots = hint_slots(capacity)
        self.families: dict[int, RefFamily] = {}  # family key -> family with items
        self.family_lists = {name: [] for name in FAMILY_TAKE_ORDER}
        self.nodes: dict[int, RefNode] = {}  # block hash -> live non-root node, every family
        self.hints: dict[int, int] = {}  # slot -> branch key the consumer drained last there
        self.num_items = 0
        self.inserted = 0
        # the consumer
        self.family: RefFamily | None = None  # held until it has no items
        self.branch: RefNode | None = None  # packed: the branch being drained

    def __len__(self) -> int:
        return self.num_items

    def add(self, handle: int, length: int, family: int, hashes, model: int = 0, max_new: int = 1,
            base: int = 0) -> None:
        """Index one item: its family key, block hashes and base as `shape_items` gives them."""
        hashes = [int(h) for h in hashes]
        fam = self.families.get(family)
        if fam is None:
            fam = self.families[family] = RefFamily(family, model)
        self.inserted += 1
        item = RefItem(handle, length, fam, max_new=max_new, seq=self.inserted)
        fam.maxnew = max(fam.maxnew, max_new)
        fam.base = max(fam.base, base)
        if fam.root is None:
            fam.root = RefNode(family, None, 0, fam)
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
                k = deep_block(len(hashes))
                if k >= 1 and parent.depth < k + 1:  # the deep block's node, between them
                    parent = self._new_node(hashes[k], parent, k + 1, fam)
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

    def _new_node(self, key: int, parent: RefNode, depth: int, fam: RefFamily) -> RefNode:
        """A node gets an item or a child in the insert that creates it: it is live at once."""
        node = RefNode(key, parent, depth, fam)
        if depth == 1:
            node.affine = self.hints.get(key % self.hint_slots) == key
        parent.children.append(node)
        self.nodes[key] = node
        return node

    @staticmethod
    def _branch_of(node: RefNode) -> RefNode | None:
        while node.depth > 1:
            node = node.parent
        return node if node.depth == 1 else None

    def _relist_branch(self, branch: RefNode) -> None:
        name = None
        if not branch.claimed and (branch.items or branch.children):
            fits = branch.maxlen <= self.contract.max_input_len
            name = "affine" if branch.affine and fits else ("fits" if fits else "overflow")
        move_to(branch.family.branch_lists, branch, name)

    def _relist_family(self, fam: RefFamily) -> None:
        name = None
        if not fam.claimed and fam.bands and fam.model == self.contract.model:
            name = "fits" if band_floor(min(fam.bands)) <= self.contract.max_input_len else "overflow"
        move_to(self.family_lists, fam, name)

    def _remove(self, item: RefItem) -> None:
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
                move_to(fam.branch_lists, node, None)
                if node.claimed or node.affine:  # the consumer served it: remember for its next turn
                    self.hints[node.key % self.hint_slots] = node.key
                if self.branch is node:
                    self.branch = None
            node = parent
        self.num_items -= 1
        if not fam.bands:
            move_to(self.family_lists, fam, None)
            del self.families[fam.key]
            if self.family is fam:
                self.family = None
        else:
            self._relist_family(fam)
