"""A producer's submitting side: prompts into its ingest ring, each under the next item id.

`Submitter` owns the ingest ring's producer side, the sequence numbers (an item id is
`producer_id << SEQ_BITS | seq`, `ring.items.item_id`) and the model ids asked for so far. The
common `submit` is one numba call: a C-contiguous uint32 array and plain ints pass numba's own type
check; anything else takes a slower path that converts it or says what is wrong. When the ring's
consumer dies it asks the producer to recover (`connection.Recover`): the same broker restarting
its ingest process is waited for; a restarted broker means new rings, and `submit` raises
`Resubmit` so that the producer submits the item again there.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import BrokerError, Full, PeerDead
from ..ring import layout as L
from ..ring.items import (
    ITEM_BAD_MAX_NEW,
    ITEM_EMPTY,
    NO_PREFIX,
    U32_MAX,
    as_tokens,
    item_id,
    model_id,
    push_item,
    push_item_readonly,
)
from ..ring.ring import Ring
from .checks import as_int, as_offsets, batch_fields, check_prefix_len, check_u32
from .connection import Recover

RESTART_POLL_SECONDS = 0.01  # how often a submit looks again while the broker restarts its ingest process


class Resubmit(Exception):
    """The broker restarted under a submit and the producer connected again: submit it again."""


class Submitter:
    """The ingest ring's producer side, its sequence numbers and the model ids (single-threaded,
    as the ring is single-producer). Not attached until `attach`; `detach` before the ring closes."""

    def __init__(self, timeout_seconds: float, recover: Recover):
        self.timeout_seconds = timeout_seconds  # how long a submit waits on a full ring by default
        self.recover = recover
        self.models: dict[str | None, int] = {None: 0}  # model name -> model id, as asked so far
        self.ring: Ring | None = None
        self.buf: np.ndarray | None = None  # the ring's words (None: not attached)
        self.seq = 0  # the sequence number of the next item
        self.id_base = 0  # the producer id's part of an item id
        self.max_tokens = 0  # the longest item the ring takes

    def attach(self, ring: Ring, producer_id: int) -> None:
        """Push into `ring` from now on, as `producer_id`; the sequence resumes where the ring's
        header says (a producer that attaches again to the same ring goes on after its last item)."""
        self.ring = ring
        self.buf = ring.buf
        self.seq = ring.next_key
        self.id_base = item_id(producer_id, 0)
        self.max_tokens = ring.max_tokens

    def detach(self) -> None:
        self.buf = None

    @property
    def next_item_id(self) -> int:
        return self.id_base | self.seq

    def model_id(self, model: str | None) -> int:
        mid = self.models.get(model)
        if mid is None:
            mid = self.models.setdefault(model, model_id(model))
        return mid

    def submit(self, tokens, max_new_tokens, prefix_len, model, block, timeout_seconds) -> int:
        """Push one item (`Producer.submit`); its item id. Resubmit when the broker restarted."""
        seq = self.seq
        if prefix_len is None and model is None and type(max_new_tokens) is int:
            # the common case in one numba call; numba's own type check refuses anything but
            # a C-contiguous uint32 array, and those go the general way below
            try:
                rc = push_item(self.buf, tokens, seq, max_new_tokens, NO_PREFIX, 0)
            except (TypeError, OverflowError):
                pass
            else:
                if rc != L.OK:
                    self._submit_slow(rc, tokens, seq, max_new_tokens, NO_PREFIX, 0, block, timeout_seconds)
                self.seq = seq + 1
                return self.id_base | seq
        prefix = NO_PREFIX if prefix_len is None else check_prefix_len(prefix_len, tokens)
        mid = self.models.get(model)
        if mid is None:
            mid = self.model_id(model)
        if type(max_new_tokens) is not int:
            max_new_tokens = as_int(max_new_tokens, "max_new_tokens")
        try:
            rc = push_item(self.buf, tokens, seq, max_new_tokens, prefix, mid)
        except TypeError:
            if self.buf is None:
                raise BrokerError("producer is closed") from None
            tokens = as_tokens(tokens)
            prefix = NO_PREFIX if prefix_len is None else check_prefix_len(prefix_len, tokens)
            push = push_item if tokens.flags.writeable else push_item_readonly
            rc = push(self.buf, tokens, seq, check_u32(max_new_tokens, "max_new_tokens"), prefix, mid)
        except OverflowError:
            raise ValueError(f"max_new_tokens must be in 0..{U32_MAX}, got {max_new_tokens}") from None
        if rc != L.OK:
            self._submit_slow(rc, tokens, seq, max_new_tokens, prefix, mid, block, timeout_seconds)
        self.seq = seq + 1
        return self.id_base | seq

    def submit_with_options(self, tokens, max_new_tokens, prefix_len, model, words: np.ndarray, block,
                            timeout_seconds) -> int:
        """Push one item whose request options' `words` follow its tokens in its record (meta[3]: how
        many); its item id. Resubmit when the broker restarted."""
        seq = self.seq
        if self.buf is None:
            raise BrokerError("producer is closed")
        tokens = as_tokens(tokens)
        if tokens.size == 0:
            raise ValueError("tokens is empty: an item needs at least one token")
        if tokens.size + words.size > self.max_tokens:
            raise ValueError(f"item of {tokens.size} tokens and {words.size} option words exceeds the ingest "
                             f"ring's limit of {self.max_tokens}")
        prefix = NO_PREFIX if prefix_len is None else check_prefix_len(prefix_len, tokens)
        mid = self.model_id(model)
        max_new = check_u32(max_new_tokens, "max_new_tokens")
        payload = np.concatenate([tokens, words])
        rc = self.ring.push(payload, seq, max_new, prefix, mid, words.size)
        if rc != L.OK:
            self._submit_slow(rc, payload, seq, max_new, prefix, mid, block, timeout_seconds, words.size)
        self.seq = seq + 1
        return self.id_base | seq

    def _submit_slow(self, rc, tokens, seq, max_new_tokens, prefix, mid, block, timeout_seconds, flags=0) -> None:
        """What push_item's return code `rc` (not OK) asks for: a wake-up, an error, or a wait."""
        if rc == L.OK_WAKE:
            self.ring.data_bell.ring()
            return
        if rc == ITEM_EMPTY:
            raise ValueError("tokens is empty: an item needs at least one token")
        if rc == ITEM_BAD_MAX_NEW:
            raise ValueError(f"max_new_tokens must be in 0..{U32_MAX}, got {max_new_tokens}")
        if rc == L.TOO_LARGE:
            raise ValueError(f"item of {tokens.size} tokens exceeds the ingest ring's limit of {self.max_tokens}")
        assert rc == L.FULL
        if not block:
            raise Full("ingest ring is full")
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.ring.push_wait(tokens, seq, max_new_tokens, prefix, mid, flags, max(0.0, deadline - time.monotonic()))
                return
            except PeerDead:
                if self.recover():
                    # the broker went away: its next incarnation salvaged what the ring held;
                    # the producer is on new rings (a new producer id): push this item there
                    raise Resubmit() from None
                # the same broker restarts its ingest process: the ring stays, wait on
                if time.monotonic() >= deadline:
                    raise Full(f"ingest ring stayed full for {timeout} s (its ingest process is restarting)") from None
                time.sleep(RESTART_POLL_SECONDS)

    def submit_many(self, flat_tokens, offsets, max_new_tokens, prefix_len, model, block, timeout_seconds,
                    words: np.ndarray | None = None) -> np.ndarray:
        """Push many items (`Producer.submit_many`); their item ids (uint64). Every item is checked
        before any is written; a broker restarted meanwhile gets the rest. `words`: the request
        options' words every item carries after its tokens (None: none)."""
        flat = as_tokens(flat_tokens, "flat_tokens")
        k = 0 if words is None else words.size
        offs = as_offsets(offsets, flat.size, self.max_tokens - k)
        count = offs.size - 1
        mid = self.model_id(model)
        fields = batch_fields(max_new_tokens, prefix_len, offs)
        meta = np.zeros((1 if fields.shared else count, L.META_WORDS), np.uint32)
        meta[:, 0] = fields.max_new
        meta[:, 1] = NO_PREFIX if fields.prefixes is None else fields.prefixes
        meta[:, 2] = mid
        meta[:, 3] = k  # the option words after each item's tokens (spill/collect.py)
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + (timeout if block else 0.0)
        out = np.empty(count, np.uint64)
        done = 0
        while True:
            seq0 = self.seq
            ids = np.arange(self.id_base | seq0, (self.id_base | seq0) + count - done, dtype=np.uint64)
            part = offs[done:] - offs[done]
            sub = flat[offs[done] : offs[-1]]
            m = meta if meta.shape[0] == 1 else meta[done:]
            try:
                self.ring.push_many(sub, part, seq0, m, max(0.0, deadline - time.monotonic()),
                                    words if k else None)
            except Full as exc:
                self.seq = seq0 + exc.submitted
                out[done : done + exc.submitted] = ids[: exc.submitted]
                done += exc.submitted
                raise Full(str(exc), submitted=done, ids=out[:done]) from None
            except PeerDead as exc:
                pushed = getattr(exc, "submitted", 0)
                self.seq = seq0 + pushed
                out[done : done + pushed] = ids[:pushed]
                done += pushed
                if self.recover():
                    continue  # the broker restarted: the rest goes to the new one
                if time.monotonic() >= deadline:
                    raise Full("ingest ring stayed full (its ingest process is restarting)", submitted=done,
                               ids=out[:done]) from None
                time.sleep(RESTART_POLL_SECONDS)  # the same broker restarts its ingest process: wait on
                continue
            self.seq = seq0 + count - done
            out[done:] = ids
            return out
