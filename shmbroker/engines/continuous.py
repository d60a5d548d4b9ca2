"""Continuous batching, modeled: how a paged-KV engine (vLLM, TensorRT-LLM, SGLang) spends a step.

    engine = ContinuousSim(max_batch_size, max_batch_tokens, cache_tokens, cost)
    engine.add(key, blocks, length, max_new)     # blocks: [(hash, tokens), ...] (ItemShapes.sized_blocks)
    seconds, finished = engine.step()            # one engine step; finished: keys, in completion order

Items wait in FIFO order (`add` order). One step, as vLLM's scheduler builds it:

1. Every decoding sequence decodes one token (vLLM schedules running requests before waiting
   ones; among them this model puts decodes first).
2. Sequences still prefilling continue with a chunk of what is left of their prompt, in
   admission order, within the step's token budget: `max_batch_tokens` tokens a step in all,
   prefill chunk tokens plus one per decoding sequence (vLLM's `max_num_batched_tokens`).
3. Waiting items are admitted in FIFO order while the budget lasts and fewer than
   `max_batch_size` sequences run (vLLM's `max_num_seqs`; if it exceeds `max_batch_tokens` the
   latter bounds the running sequences, as vLLM requires). On admission an item looks up its
   longest cached prefix (its leading blocks found in the cache, stopping at the first miss);
   those are hits and are not computed. It computes the rest, at least one token (an item whose
   whole prompt is cached recomputes its last token, as vLLM does, to produce its first output).
   Its first chunk is as large as the remaining budget allows.
4. A block enters the cache when the chunk that completes it is scheduled (vLLM caches full
   blocks when it allocates them, so an item admitted later in the same step already hits
   them). The first output token comes out of the prefill's last chunk; an item with
   `max_new <= 1` finishes in that step, any other decodes `max_new - 1` more steps.

The cache is an LRU of blocks holding at most `cache_tokens` tokens that no running sequence
uses. A running sequence's blocks (hit or computed) are pinned: they stay cached while it runs
and do not count as evictable; when it finishes they are released to the most recently used
end, its last block first, so its tail is evicted before its prefix (vLLM's free-block queue).
Pinned blocks may hold the cache above `cache_tokens`: the engine's KV memory is not modeled
as an admission limit (the contract's `max_batch_size` is); while over, nothing unpinned is
kept. A block longer than `cache_tokens` is never cached; a pooled item's input (a negative
hash, `ItemShapes.sized_blocks`) never is. Generated tokens are not cached (they are not in
any prompt's block hashes).

Cost of one step (`cost.SimCost`, the same parameters as the batch model in `sim.py`):

    seconds = (decode_step_seconds if any sequence decodes else batch_overhead_seconds)
            + decode_token_seconds  x decoding sequences
            + prefill_token_seconds x prefill tokens computed in the step

so an item run alone, its prompt in one step, costs exactly what the batch model charges a
batch of one: batch_overhead + prefill + (max_new - 1) x (decode_step + decode_token).
`zero_cost` makes every step free (the counters still count).

Counters (cumulative): steps, seconds, hit_blocks, queried_blocks (blocks looked up at
admission: all of an item's blocks), computed_tokens (prefill tokens computed), decode_tokens
(tokens decoded after the first), scheduled_tokens (prefill + decode tokens, for the budget's
fill), running_steps (running sequences summed over steps, for the slots' fill), admitted,
finished. `last_hits` maps each key finished by the last step to (hit_blocks, queried_blocks), and
`last_cached` to the prompt tokens its cached blocks held (what vLLM reports as `num_cached_tokens`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

from .cost import SimCost


class _Seq:
    __slots__ = ("blocks", "done_tokens", "hit_blocks", "hit_tokens", "key", "length", "max_new", "next_block",
                 "pinned", "remaining")

    def __init__(self, key, blocks, length, max_new):
        self.key = key
        self.blocks = blocks
        self.length = length
        self.max_new = max_new
        self.hit_blocks = 0
        self.hit_tokens = 0  # prompt tokens of its cached blocks
        self.next_block = 0  # the first block not yet scheduled (cached or computed)
        self.done_tokens = 0  # tokens of blocks[next_block] already scheduled
        self.remaining = 0  # prefill tokens left to compute
        self.pinned: list = []  # hashes this sequence holds pinned, in block order


class ContinuousSim:
    """A continuous-batching engine in modeled time; see the module docstring."""

    def __init__(self, max_batch_size: int, max_batch_tokens: int, cache_tokens: int, cost: SimCost | None = None):
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_size and max_batch_tokens must be positive")
        if cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {cache_tokens}")
        self.max_batch_size = int(max_batch_size)
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_running = min(self.max_batch_size, self.max_batch_tokens)
        self.cache_tokens = int(cache_tokens)
        if cost is None:
            cost = SimCost()
        self.cost = cost
        self._waiting: deque = deque()
        self._prefilling: deque = deque()  # admitted, prompt not finished, in admission order
        self._decoding: list = []  # heap of (step of the last token, order, seq)
        self._order = 0
        self._lru: OrderedDict = OrderedDict()  # unpinned cached blocks: hash -> tokens, LRU first
        self._pins: dict = {}  # pinned cached blocks: hash -> [tokens, references]
        self._cached_tokens = 0  # tokens of every cached block, pinned or not
        self.steps = 0
        self.seconds = 0.0
        self.hit_blocks = 0
        self.queried_blocks = 0
        self.computed_tokens = 0
        self.decode_tokens = 0
        self.scheduled_tokens = 0
        self.running_steps = 0
        self.admitted = 0
        self.finished = 0
        self.last_hits: dict = {}
        self.last_cached: dict = {}

    # ---- the interface ------------------------------------------------------------------------

    def add(self, key, blocks, length: int, max_new: int) -> None:
        """Queue an item (FIFO). blocks: [(hash, tokens), ...] covering its `length` tokens."""
        assert length >= 1, "an item has at least one token"
        assert sum(t for _, t in blocks) == length, "blocks must cover the item's tokens"
        self._waiting.append(_Seq(key, blocks, int(length), max(1, int(max_new))))

    @property
    def running(self) -> int:
        """Sequences admitted and not finished (prefilling or decoding)."""
        return len(self._prefilling) + len(self._decoding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._prefilling or self._decoding)

    def step(self) -> tuple[float, list]:
        """Run one step: (modeled seconds, keys finished in it). An idle engine returns (0.0, [])."""
        self.last_hits = {}
        self.last_cached = {}
        if self.idle:
            return 0.0, []
        budget = self.max_batch_tokens
        decoding = len(self._decoding)
        assert decoding <= budget, "running sequences are bounded by the token budget"
        budget -= decoding
        prefill = 0
        completed: list = []  # sequences whose prompt is done this step
        for seq in self._prefilling:
            if budget == 0:
                break
            chunk = self._schedule(seq, budget)
            budget -= chunk
            prefill += chunk
            if seq.remaining == 0:
                completed.append(seq)
        while self._waiting and budget > 0 and self.running < self.max_running:
            seq = self._waiting.popleft()
            self._admit(seq)
            self._prefilling.append(seq)
            chunk = self._schedule(seq, budget)
            budget -= chunk
            prefill += chunk
            if seq.remaining == 0:
                completed.append(seq)
        assert prefill or decoding, "a busy engine schedules something every step"
        step = self.steps
        self.steps += 1
        self.running_steps += self.running
        self.decode_tokens += decoding
        self.computed_tokens += prefill
        self.scheduled_tokens += prefill + decoding
        cost = self.cost
        seconds = 0.0 if cost.zero_cost else (
            (cost.decode_step_seconds if decoding else cost.batch_overhead_seconds)
            + cost.decode_token_seconds * decoding + cost.prefill_token_seconds * prefill)
        self.seconds += seconds
        done: list = []
        for seq in completed:  # the first output token
            self._prefilling.remove(seq)
            if seq.max_new <= 1:
                done.append(seq)
            else:
                self._order += 1
                heapq.heappush(self._decoding, (step + seq.max_new - 1, self._order, seq))
        while self._decoding and self._decoding[0][0] == step:
            done.append(heapq.heappop(self._decoding)[2])
        keys = []
        for seq in done:
            self._release(seq)
            self.last_hits[seq.key] = (seq.hit_blocks, len(seq.blocks))
            self.last_cached[seq.key] = seq.hit_tokens
            keys.append(seq.key)
        self.finished += len(done)
        return seconds, keys

    # ---- prefix cache ---------------------------------------------------------------------------

    def _admit(self, seq: _Seq) -> None:
        self.admitted += 1
        self.queried_blocks += len(seq.blocks)
        hit_tokens = 0
        for h, t in seq.blocks:
            if h < 0 or not self._pin_cached(h):
                break
            seq.pinned.append(h)
            seq.hit_blocks += 1
            hit_tokens += t
        seq.next_block = seq.hit_blocks
        self.hit_blocks += seq.hit_blocks
        seq.remaining = max(1, seq.length - hit_tokens)
        seq.hit_tokens = hit_tokens

    def _pin_cached(self, h) -> bool:
        pin = self._pins.get(h)
        if pin is not None:
            pin[1] += 1
            return True
        t = self._lru.pop(h, None)
        if t is None:
            return False
        self._pins[h] = [t, 1]
        return True

    def _schedule(self, seq: _Seq, budget: int) -> int:
        """Schedule a chunk of seq's prompt within budget (> 0); caches the blocks it completes."""
        chunk = min(seq.remaining, budget)
        seq.remaining -= chunk
        left = chunk
        blocks = seq.blocks
        while left and seq.next_block < len(blocks):
            h, t = blocks[seq.next_block]
            take = min(left, t - seq.done_tokens)
            left -= take
            seq.done_tokens += take
            if seq.done_tokens == t:
                self._store(seq, h, t)
                seq.next_block += 1
                seq.done_tokens = 0
        return chunk

    def _store(self, seq: _Seq, h, t: int) -> None:
        if h < 0 or t > self.cache_tokens:
            return
        if not self._pin_cached(h):  # another running sequence may have computed it meanwhile
            self._pins[h] = [t, 1]
            self._cached_tokens += t
            self._evict()
        seq.pinned.append(h)

    def _release(self, seq: _Seq) -> None:
        for h in reversed(seq.pinned):
            pin = self._pins[h]
            pin[1] -= 1
            if pin[1] == 0:
                del self._pins[h]
                self._lru[h] = pin[0]
        seq.pinned = []
        self._evict()

    def _evict(self) -> None:
        lru = self._lru
        while self._cached_tokens > self.cache_tokens and lru:
            self._cached_tokens -= lru.popitem(last=False)[1]

    @property
    def cached_tokens(self) -> int:
        """Tokens of the cached blocks, pinned or not."""
        return self._cached_tokens
