"""The policy: which family, band and branch each consumer is served next.

Mechanism (the walks: sweep.py, branches.py; the guard and the commit: commit.py) and policy are
apart: the packer asks the consumer's policy object for a decision; nothing in
the packer branches on a mode. A decision is one compiled call (numba's call
overhead with the index's arrays is a few microseconds, paid once) and comes
back as a `Decision`. The lists this policy takes from (which class list an
unclaimed family or branch waits in, a branch's affine consumer) are kept by
the index as items come and go, by the rules of `listing.py`.

Shared by both modes (`choose_family`):
1. Aging: the oldest item this consumer can take that has waited longer than
   `max_wait_seconds` decides the family (and its band or branch) first.
2. Stickiness: a consumer keeps its family until it has nothing left there
   for it (no excess shape switches; its cache holds that prefix).
3. A new family comes from the class lists: first the classes only this
   consumer (or a bigger one) can take, so the big card takes the long work
   and the small card keeps what it can do; a claimed family is off the other
   consumers' lists (a prefix is cached on one card). Of the first
   max_batch_size families of that list, the one that takes the most engine
   steps goes first (longest processing time first, so a drain does not end on
   a long generation or on a family one card drains alone): at least its
   longest generation, its pending tokens over max_batch_tokens, its pending
   generations over max_batch_size (`family_steps`; ties keep the
   list's order). Every consumer takes the longest first (the smaller cards
   taking the shortest measured worse: they end on the long ones). Packed
   consumers only: a padded one takes the head of the list (it runs batches
   one at a time, so it has no tail of running sequences to shorten, and the
   order measured worse there).
4. With no unclaimed family left, a consumer shares another's family (packed:
   branches stay apart, and with no branch left a consumer takes over the last
   children of another's, so a family that is one branch is shared too;
   padded: the sweeps run in opposite directions).

`PaddedPolicy` (rectangle engines) sweeps a family's length bands: the largest
consumer of a model from the top down, the others from the bottom up, so
batches are as long as the contract allows and padding stays within the
tolerance (longest <= (1 + tol) x shortest). A rectangle engine decodes every
row until the batch's longest max_new_tokens, so the decode rectangle is
padding too: of the items the sweep meets within the tolerance (up to
CANDIDATES_PER_SLOT x max_batch_size of them) a batch takes the longest
generations first, and the rest wait for the next batch, among items of
output lengths like theirs. When a family generates (max_new_tokens > 1),
the decode rectangle is the bigger cost (a decode step costs about the same
for one row or the whole batch), so when its band within the tolerance
cannot fill the rectangle, its batches are grouped by generation first and
the tolerance no longer cuts the input band: the contract does
(count x longest <= max_batch_tokens), the tolerance only spacing the input
caps tried (sweep.py `generation_cap`). Measured (bench pack, the trace's own
output lengths): a 1/16 input band on the generator's small families made
batches of 4.6 items and lost to FIFO (1.11x); so did a cap on the padded
share of the whole rectangle counted in token cells (1.37x at 1/16).
Prefill-only work (max_new_tokens 1) keeps the tolerance band.

Before any of that, a generating family is weighed (`loose.family_pays`, with the consumer's
`step_tokens`: the prefill tokens a decode step costs): unless its own rectangle pays for its
padding (it fills one, and its shared prefix computed once saves more than its outputs' spread
costs in steps), the batch is a loose rectangle across families, cut from the lanes by output
band, then input band (`loose.select_loose`), and the consumer lets the family go. One-off
prompts, short agent chains and a trace's one big family of unrelated conversations all batch
loose; template jobs (a long shared prefix, one cap) keep their family rectangles. Measured
(bench pack, --max-new-tokens 0): 0.24-0.59 x FIFO on the generator, the trace and the
workload families, where the family rectangles alone gave 0.39-1.92.

`PackedPolicy` (paged-KV engines) drains branches depth-first, so each turn
of a conversation follows its parent while the parent's blocks are cached,
and its batch records are ordered groups of up to max_batch_size items (the
engine keeps them in flight: no count x longest bound). Longer generations
start first: a new branch is, of the first max_batch_size listed (about what
the engine starts while one generation runs), the one with the longest
max_new_tokens, so a drain does not end with one sequence decoding alone.
What is in flight stays within one family per consumer: a consumer keeps its
family until it is drained (stickiness, above) and claims its branches one at
a time, so the prefixes in flight are those of the few conversations its
window holds, whose blocks the engine keeps while they run.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..jit import kernel
from .ages import oldest
from .branches import claim_item_branch, goes_before, select_packed
from .commit import finish
from .contract import DEFAULT_STEP_TOKENS, LOOSE_FAMILY, Mode
from .links import family_list_set
from .listing import family_reclass
from .loose import family_pays, select_loose
from .shapes import NUM_BANDS, band_of
from .state import C_BAND, C_FAM, C_MAXIN, State
from .sweep import generates, select_padded

DEFAULT_PADDING_TOLERANCE = 1 / 16
FAMILY_ATTEMPTS = 8
CANDIDATES_PER_SLOT = 4  # padded: a batch picks its items among up to 4 x max_batch_size candidates
NO_AGING = -1.0
_new_tuple = tuple.__new__


class Decision(NamedTuple):
    """What a decision did: the batch is out[:num_items] (rows gathered), the failures out of the
    index are failed[:num_failed] (their item ids in failed_ids); family is its slot, -1 when no
    family had anything for the consumer; code is the guard's (0: passed)."""

    num_items: int
    num_failed: int
    family: int
    code: int
    length_min: int
    length_max: int
    family_key: int


# ---- families: which one a consumer takes next ------------------------------------------------

@kernel(inline="always", _nrt=False)
def contains(values, n, x):
    for i in range(n):
        if values[i] == x:
            return True
    return False


@kernel(inline="always", _nrt=False)
def family_steps(fm, f, bs, bt):
    """The engine steps family f takes at least on a consumer of max_batch_size bs and max_batch_tokens
    bt: its longest generation, its pending tokens over bt, its pending generations over bs."""
    return max(np.int64(fm[f].maxnew), fm[f].tokens // bt, fm[f].generate // bs)


@kernel(_nrt=False)
def take_family(S, c, cls_order, skip, nskip, scan, longest, bs, bt):
    """Claim an unclaimed family not in skip[:nskip] from the first class list (in cls_order) that
    has one: of its first `scan` such families, the one that takes the most steps (`family_steps`;
    `longest`, else the fewest; the first among equals); or -1."""
    fm = S.families
    gh = S.family_heads
    for k in range(cls_order.size):
        best = -1
        most = 0
        seen = 0
        f = gh[cls_order[k]]
        while f != -1 and seen < scan:
            if not contains(skip, nskip, f):
                seen += 1
                steps = family_steps(fm, f, bs, bt)
                if best == -1 or goes_before(steps, most, longest):
                    best = f
                    most = steps
            f = fm[f].gnext
        if best != -1:
            family_list_set(fm, gh, S.family_tails, best, -1)
            fm[best].claimed = c + 1
            return best
    return -1


@kernel(_nrt=False)
def release_family(S, c):
    """c leaves its current family: unclaim it if c held it."""
    f = S.consumers[c, C_FAM]
    if f == -1:
        return
    S.consumers[c, C_FAM] = -1
    if S.families[f].claimed == c + 1:
        S.families[f].claimed = 0
        family_reclass(S, f)


@kernel(_nrt=False)
def choose_family(S, c, attempt, ip, fp, cls_order, age_own, skip, now):
    """(family or -1, aged item slot or -1) for consumer c, with the decide kernels' parameter words
    `ip` and floats `fp` (P_*, F_* below).

    Aging looks first at the classes no smaller consumer can take (age_own), then at all of c's."""
    cons = S.consumers
    fm = S.families
    max_wait = fp[F_MAXWAIT]
    model = ip[P_MODEL]
    if attempt == 0 and max_wait >= 0.0:
        slot = oldest(S, age_own, now - max_wait)
        if slot == -1:
            slot = oldest(S, cls_order, now - max_wait)
        if slot != -1:
            f = S.items[slot].fam
            if cons[c, C_FAM] != f:
                release_family(S, c)
                cons[c, C_FAM] = f
            return f, slot
    if attempt > 0:
        skip[attempt - 1] = cons[c, C_FAM]
        release_family(S, c)
    f = cons[c, C_FAM]
    if f != -1:
        return f, -1
    f = take_family(S, c, cls_order, skip, attempt, ip[P_SCAN], True, ip[P_BS], ip[P_BT])
    if f == -1:
        for d in range(cons.shape[0]):
            g = cons[d, C_FAM]
            if d != c and g != -1 and fm[g].model == model and not contains(skip, attempt, g):
                f = g
                break
    if f != -1:
        cons[c, C_FAM] = f
        cons[c, C_BAND] = -1  # entering: the sweep starts at its far end
    return f, -1


# decide kernels' parameter words (ints) and floats
P_C, P_MODEL, P_BS, P_BT, P_MAXIN, P_MODELMAX, P_DESC, P_SCAN = range(8)
F_MAXWAIT, F_TOL, F_STEP = range(3)


@kernel(_nrt=False)
def overdue_alone(S, now, ip, fp, cls_order, out, failed, rows, failed_ids):
    """Rather than idle, serve the oldest overdue item c can take on its own (its shape is then
    held by another consumer or mixed with longer work)."""
    if fp[F_MAXWAIT] < 0.0:
        return 0, 0, -1, 0, 0, 0, np.uint64(0)
    slot = oldest(S, cls_order, now - fp[F_MAXWAIT])
    if slot == -1:
        return 0, 0, -1, 0, 0, 0, np.uint64(0)
    out[0] = slot
    f = S.items[slot].fam
    n = np.int64(S.items[slot].length)
    family_key = S.families[f].key
    code = finish(S, out, 1, failed, 0, family_key, ip[P_MODEL], n, n, 0.0, ip[P_BS], ip[P_BT], ip[P_MAXIN], True, rows,
                  failed_ids)
    return 1, 0, f, code, n, n, family_key


@kernel(_nrt=False)
def decide_padded(arrays, now, ip, fp, cls_order, age_own, skip, out, failed, rows, failed_ids, cand, sort_keys):
    """(items, failed, family slot, guard code, shortest, longest, family key): a `Decision`."""
    S = State(*arrays)
    cons = S.consumers
    c = ip[P_C]
    descending = ip[P_DESC] != 0
    far = NUM_BANDS - 1 if descending else 0
    for attempt in range(FAMILY_ATTEMPTS):
        f, aged = choose_family(S, c, attempt, ip, fp, cls_order, age_own, skip, now)
        if f == -1:
            break
        if generates(S.families, f, fp[F_TOL]) and not family_pays(S.families, f, ip[P_BS], ip[P_BT], fp[F_STEP]):
            # its own rectangle is not worth its padding: a loose one from the lanes (loose.py)
            n, nf, lo, hi = select_loose(S, c, cls_order, descending, ip[P_BS], ip[P_BT], ip[P_MAXIN],
                                         ip[P_MODELMAX], fp[F_STEP], out, failed, aged)
            if n or nf:
                release_family(S, c)
                code = finish(S, out, n, failed, nf, np.uint64(LOOSE_FAMILY), ip[P_MODEL], lo, hi, np.inf,
                              ip[P_BS], ip[P_BT], ip[P_MAXIN], True, rows, failed_ids)
                return n, nf, f, code, lo, hi, np.uint64(LOOSE_FAMILY)
        if aged != -1:
            cons[c, C_BAND] = band_of(S.items[aged].length)
        start = cons[c, C_BAND]
        if start == -1:
            start = far
        n, nf, band, lo, hi = select_padded(S, f, start, descending, ip[P_BS], ip[P_BT], ip[P_MAXIN],
                                            ip[P_MODELMAX], fp[F_TOL], out, failed, cand, sort_keys)
        cons[c, C_BAND] = far if band == -1 else band
        if n or nf:
            family_key = S.families[f].key
            # a generating batch's input band is bounded by the contract, not the tolerance (sweep.py)
            tol = np.inf if generates(S.families, f, fp[F_TOL]) else fp[F_TOL]
            code = finish(S, out, n, failed, nf, family_key, ip[P_MODEL], lo, hi, tol, ip[P_BS], ip[P_BT],
                          ip[P_MAXIN], True, rows, failed_ids)
            return n, nf, f, code, lo, hi, family_key
    return overdue_alone(S, now, ip, fp, cls_order, out, failed, rows, failed_ids)


@kernel(_nrt=False)
def decide_packed(arrays, now, ip, fp, cls_order, age_own, skip, out, failed, rows, failed_ids, cand, sort_keys):
    """(items, failed, family slot, guard code, 1, max_input_len, family key): a `Decision`."""
    S = State(*arrays)
    c = ip[P_C]
    for attempt in range(FAMILY_ATTEMPTS):
        f, aged = choose_family(S, c, attempt, ip, fp, cls_order, age_own, skip, now)
        if f == -1:
            break
        if aged != -1:
            claim_item_branch(S, c, aged, ip[P_MAXIN])
        n, nf = select_packed(S, f, c, ip[P_BS], ip[P_MAXIN], ip[P_MODELMAX], cls_order, ip[P_SCAN], True,
                              out, failed)
        if n or nf:
            family_key = S.families[f].key
            code = finish(S, out, n, failed, nf, family_key, ip[P_MODEL], 1, ip[P_MAXIN], np.inf, ip[P_BS], ip[P_BT],
                          ip[P_MAXIN], False, rows, failed_ids)
            return n, nf, f, code, np.int64(1), ip[P_MAXIN], family_key
    return overdue_alone(S, now, ip, fp, cls_order, out, failed, rows, failed_ids)


class Policy:
    tol = None

    def __init__(self, index, c: int, contract, model_max: int, max_wait_seconds: float | None):
        self.index = index
        self.c = c
        self.contract = contract
        self.model_max = model_max
        self.max_wait = NO_AGING if max_wait_seconds is None else float(max_wait_seconds)
        classes = index.classes
        mine = [k for k in range(len(classes)) if classes[k, 0] == contract.model]
        own = [k for k in mine if classes[k, 1] <= contract.max_input_len]
        overflow = [k for k in mine if classes[k, 1] > model_max]
        largest = contract.max_input_len == model_max
        order = (overflow if largest else []) + sorted(own, key=lambda k: -classes[k, 1])
        self.cls_order = np.array(order, np.int64)
        # classes no smaller consumer of the model takes: above the next smaller max_input_len
        below = [classes[k, 1] for k in mine if classes[k, 1] < contract.max_input_len]
        floor = max(below) if below else 0
        self.age_own = np.array([k for k in order if classes[k, 1] > floor], np.int64)
        self.descending = largest
        self.skip = np.full(FAMILY_ATTEMPTS, -1, np.int64)
        index.cons[c, C_MAXIN] = contract.max_input_len
        self.ip = np.array([c, contract.model, contract.max_batch_size, contract.max_batch_tokens,
                            contract.max_input_len, model_max, int(largest), contract.max_batch_size], np.int64)
        # padded: the candidates a batch's items are chosen from (sweep.select_padded)
        self.cand = np.empty(CANDIDATES_PER_SLOT * contract.max_batch_size, np.int64)
        self.sort_keys = np.empty(self.cand.size, np.int64)
        self.fp = np.array([self.max_wait, 0.0, DEFAULT_STEP_TOKENS], np.float64)

    def decide(self, now: float, out, failed, rows, failed_ids) -> Decision:
        """One decision for this consumer; out, failed, rows and failed_ids are filled (`Decision`)."""
        # tuple.__new__: Decision._make without its length check (a decision is a few microseconds)
        return _new_tuple(Decision, self.kernel(self.index.arrays, now, self.ip, self.fp, self.cls_order,
                                                self.age_own, self.skip, out, failed, rows, failed_ids, self.cand,
                                                self.sort_keys))


class PaddedPolicy(Policy):
    kernel = staticmethod(decide_padded)

    def __init__(self, *args, tol: float = DEFAULT_PADDING_TOLERANCE, step_tokens: float = DEFAULT_STEP_TOKENS, **kw):
        super().__init__(*args, **kw)
        if not 0 <= tol:
            raise ValueError(f"padding tolerance must be >= 0, got {tol}")
        if not 0 <= step_tokens < float("inf"):
            raise ValueError(f"decode step tokens must be >= 0, got {step_tokens}")
        self.tol = float(tol)
        self.fp[F_TOL] = self.tol
        self.fp[F_STEP] = float(step_tokens)
        self.ip[P_SCAN] = 1  # families in list order: batches run one at a time, there is no tail to shorten



class PackedPolicy(Policy):
    kernel = staticmethod(decide_packed)



POLICIES = {Mode.PADDED: PaddedPolicy, Mode.PACKED: PackedPolicy}
