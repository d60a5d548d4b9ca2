"""The commit of a decision: gather the batch's rows, run the guard, then remove its items from the index.

Only a batch the guard passes leaves the index; a refused one stays indexed
with its branches put back in their lists (`unclaim`), so a refusal loses
nothing. Items a walk failed back (the standalone `Packer`'s too-long items)
leave the index with the batch.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .contract import LOOSE_FAMILY
from .guard import OK, check_rows
from .index import remove_quiet
from .listing import branch_reclass, family_reclass
from .state import C_BRANCH


@kernel(_nrt=False)
def unclaim(S, slots, n):
    """Put back the branches of a refused batch's items (claimed, but no longer any consumer's)."""
    it = S.items
    nd = S.nodes
    cons = S.consumers
    for i in range(n):
        x = nd[it[slots[i]].node].branch
        if x != -1 and nd[x].claimed != 0 and cons[nd[x].claimed - 1, C_BRANCH] != x:
            nd[x].claimed = 0
            branch_reclass(S, x)


@kernel(_nrt=False)
def gather(S, slots, n, rows):
    it = S.items
    fm = S.families
    for i in range(n):
        slot = slots[i]
        rows[i].handle = it[slot].handle
        rows[i].num_tokens = it[slot].length
        rows[i].max_new_tokens = it[slot].max_new
        rows[i].arrival = it[slot].arrival
        rows[i].prefix_key = fm[it[slot].fam].key
        rows[i].model = fm[it[slot].fam].model


@kernel(_nrt=False)
def finish(S, out, n, failed, nf, family_key, model, length_min, length_max, tol, bs, bt, max_in, rectangle, rows,
           failed_ids):
    """Gather the batch, run the guard, then remove its items (and the failed ones) from the index.

    Returns the guard's code; on a refusal the batch's items stay indexed (their branches unclaimed)."""
    gather(S, out, n, rows)
    it = S.items
    for i in range(nf):
        failed_ids[i] = it[failed[i]].handle
    code = OK
    if n:
        code = check_rows(rows, n, family_key, model, length_min, length_max, tol, bs, bt, max_in, rectangle)
        if code != OK:
            unclaim(S, out, n)
            n = 0
    alive = -1
    loose = family_key == np.uint64(LOOSE_FAMILY)
    for i in range(n):
        alive = remove_quiet(S, out[i])
        if loose and alive != -1:  # a loose rectangle's items come from many families
            family_reclass(S, alive)
    for i in range(nf):
        alive = remove_quiet(S, failed[i])
        if loose and alive != -1:
            family_reclass(S, alive)
    if alive != -1 and not loose:  # every item came from one family
        family_reclass(S, alive)
    return code
