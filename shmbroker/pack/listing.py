"""The policy's listing rules: in which list an unclaimed family or branch waits, and who a branch is affine to.

The index (`index.py`) keeps its lists as items come and go; where a family or a branch is
listed, and what a dying branch leaves behind for the next turn of its conversation, is policy,
decided here:

- **Classes**: consumers' distinct `max_input_len` values per model, ascending, plus an overflow
  class per model for items no consumer of it can take (`class_of`). Items sit in per-class age
  lists; families (by their shortest pending item) and branches (by their longest item) in
  per-class lists, which the policy (`policy.py`) walks in a consumer's order.
- **Affinity**: a branch (a conversation's first block) that dies leaves in a direct-mapped hint
  table which consumer served it (`remember_server`); a branch created again with that key is
  affine to that consumer (`hinted_consumer`), and listed in that consumer's own list while it
  fits it (`branch_reclass`), so the next turn goes where its prefix is cached.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .bands import band_next
from .links import branch_list_set, family_list_set
from .shapes import band_floor
from .state import C_MAXIN


@kernel(_nrt=False)
def class_of(cls, model, length):
    """First class (rows of cls: model, max_input_len; sorted) of `model` that fits `length`.

    Each model's last class is its overflow class (items no consumer of it can take);
    cls.shape[0] is the class of models that no consumer serves.
    """
    for k in range(cls.shape[0]):
        if cls[k, 0] == model and length <= cls[k, 1]:
            return k
    return cls.shape[0]


@kernel(inline="always", _nrt=False)
def family_reclass(S, f):
    """Put an unclaimed family in the class list of its shortest pending item."""
    fm = S.families
    if fm[f].claimed != 0 or fm[f].pending == 0:
        family_list_set(fm, S.family_heads, S.family_tails, f, -1)
        return
    b = band_next(S.band_bits, S.band_summary, f, 0)
    family_list_set(fm, S.family_heads, S.family_tails, f, class_of(S.classes, fm[f].model, band_floor(b)))


@kernel(inline="always", _nrt=False)
def branch_reclass(S, x):
    """List an unclaimed live branch: in its affine consumer's list when that consumer fits it,
    else in the class list of its longest item. Lists 0..K are classes, K+1+c consumer c's."""
    nd = S.nodes
    if nd[x].claimed != 0 or nd[x].live == 0:
        branch_list_set(nd, S.branch_heads, S.branch_tails, x, -1)
        return
    a = nd[x].affine
    if a != -1 and nd[x].maxlen <= S.consumers[a, C_MAXIN]:
        branch_list_set(nd, S.branch_heads, S.branch_tails, x, S.classes.shape[0] + 1 + a)
    else:
        branch_list_set(nd, S.branch_heads, S.branch_tails, x,
                         class_of(S.classes, S.families[nd[x].fam].model, nd[x].maxlen))


@kernel(inline="always", _nrt=False)
def hinted_consumer(S, block_hash):
    """The consumer that served the last branch of this key to die (its hint slot), or -1."""
    h = np.int64(block_hash & np.uint64(S.hint_keys.size - 1))
    if S.hint_keys[h] == block_hash:
        return S.hint_consumers[h]
    return -1


@kernel(inline="always", _nrt=False)
def remember_server(S, x):
    """Branch x dies: remember who holds this conversation's prefix (its claimer, else the
    consumer it was affine to), for its next turn."""
    nd = S.nodes
    served = nd[x].claimed - 1 if nd[x].claimed != 0 else nd[x].affine
    if served != -1:
        h = np.int64(nd[x].hash & np.uint64(S.hint_keys.size - 1))
        S.hint_keys[h] = nd[x].hash
        S.hint_consumers[h] = served
