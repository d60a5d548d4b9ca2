"""The simulated engine: a documented cost model of a GPU inference engine.

It runs on the CPU in virtual time, so a large trace drains in seconds. Two modes (docs/design.md
"Words"):

- `padded`, a rectangle engine (transformers, static TensorRT engines): the batch's common prefix
  (the blocks every item shares) is computed once, or not at all for the blocks the previous
  batch's prefix left cached (the engine keeps the last prefix's KV, as many leading blocks as fit
  `cache_tokens`); then count x longest remaining suffix. Cache hits: every item's common-prefix
  blocks except the one computation.
- `packed`, a paged-KV engine (vLLM, TensorRT-LLM, SGLang): no padding; items run in batch order
  and each computes only its blocks after its longest cached prefix in an LRU block cache holding
  at most `cache_tokens` tokens (a block computed by an earlier item of the batch is a hit for a
  later one, as with prefix caching of completed blocks).

Cost of one batch (all parameters in `cost.SimCost`):

    seconds = batch_overhead_seconds
            + prefill_token_seconds x computed prefill tokens
            + decode_step_seconds x (longest max_new_tokens - 1)
            + decode_token_seconds x decoded sequence-steps

The first generated token comes out of prefill; decode steps follow. A padded engine decodes every
sequence for the longest max_new_tokens; a packed one retires each sequence at its own. The
defaults approximate transformers on an H200 with a ~1B-parameter model (docs/design.md: about
130k prefill tokens/s); they are not calibrated against real engines. `zero_cost` makes every
batch free, so a benchmark measures the broker, not the model.

`SimEngine` is the cost model over block hashes (the packing benchmark drives
it directly); `Sim` puts it behind the engine interface (`base.py`) for a GPU
process: token ids in, generated token ids and cache figures out.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import crc32c
import numpy as np

from ..pack.contract import Mode, as_mode
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, shape_items
from .base import BatchResults, EngineOutcome, StreamingRun
from .cost import SimCost
from .faults import SimFaults
from ..request.extras import decode_extras
from .options import embeds
from .sim_embed import SimEmbedder
from .sim_requests import item_keys, sample_key, sampled_result, with_cached
from .sim_structured import StructuredText, unmodeled


@dataclass
class BatchCost:
    items: int
    input_tokens: int
    computed_tokens: int
    padded_tokens: int  # rectangle cells that compute nothing (padded mode)
    rect_tokens: int  # count x longest suffix (padded mode), the denominator of padding waste
    prefix_tokens: int  # the batch's common prefix (padded mode)
    hit_blocks: int
    queried_blocks: int
    seconds: float


@dataclass
class CacheFigures:
    """What the engine's cache did since the last poll (an EngineOutcome's figures)."""

    hit_blocks: int = 0
    queried_blocks: int = 0
    padded_tokens: int = 0
    rect_tokens: int = 0


class SimEngine:
    """Blocks come from `ItemShapes` (pack/shapes.py): the family key is an item's first block."""

    def __init__(self, mode: Mode, *, cache_tokens: int, block_tokens: int, cost: SimCost = SimCost()):
        mode = as_mode(mode, "sim engine mode")
        if cache_tokens < 0 or block_tokens < 1:
            raise ValueError("cache_tokens must be >= 0 and block_tokens >= 1")
        self.mode = mode
        self.block_tokens = block_tokens
        self.cache_tokens = cache_tokens
        self.cost = cost
        self._lru: OrderedDict = OrderedDict()  # block hash -> its tokens, least recently used first
        self._lru_tokens = 0
        self._last_prefix: list = []  # padded: the previous batch's common prefix blocks

    def run(self, shapes, rows, max_new_tokens, real_new=None) -> BatchCost:
        """One batch's cost. A row decodes until its real output length (`real_new`, at most its
        max_new_tokens; None: that) and then costs nothing; the batch ends when its last row stops."""
        assert shapes.block_tokens == self.block_tokens, "items hashed with another block size"
        rows = [int(r) for r in rows]
        blocks = [shapes.sized_blocks(r) for r in rows]
        lengths = [int(shapes.lengths[r]) for r in rows]
        max_new = [max(1, int(m)) for m in max_new_tokens]
        if real_new is not None:
            max_new = [max(1, min(m, int(r))) for m, r in zip(max_new, real_new)]
        cost = self._padded(blocks, lengths) if self.mode == Mode.PADDED else self._packed(blocks, lengths)
        steps = max(max_new) - 1
        seq_steps = sum(m - 1 for m in max_new)
        cost.seconds = self.cost.seconds(cost.computed_tokens, steps, seq_steps)
        return cost

    def _padded(self, blocks, lengths) -> BatchCost:
        count = len(blocks)
        common = 0
        first = blocks[0]
        while common < len(first) and all(len(b) > common and b[common] == first[common] for b in blocks):
            common += 1
        if common and any(sum(t for _, t in first[:common]) == n for n in lengths) and count > 1:
            common -= 1  # keep at least one token of every item outside the shared prefix
        prefix = first[:common]
        prefix_tokens = sum(t for _, t in prefix)
        cached = 0
        while cached < min(common, len(self._last_prefix)) and self._last_prefix[cached] == prefix[cached]:
            cached += 1
        cached_tokens = sum(t for _, t in prefix[:cached])
        # the engine keeps this batch's prefix KV for the next batch, as much of it as fits its cache
        kept = 0
        budget = self.cache_tokens
        while kept < len(prefix) and prefix[kept][1] <= budget:
            budget -= prefix[kept][1]
            kept += 1
        self._last_prefix = prefix[:kept]
        suffixes = [n - prefix_tokens for n in lengths]
        rect = count * max(suffixes)
        return BatchCost(items=count, input_tokens=sum(lengths),
                         computed_tokens=prefix_tokens - cached_tokens + rect,
                         padded_tokens=rect - sum(suffixes), rect_tokens=rect, prefix_tokens=prefix_tokens,
                         hit_blocks=count * cached + (count - 1) * (common - cached),
                         queried_blocks=sum(len(b) for b in blocks), seconds=0.0)

    def _packed(self, blocks, lengths) -> BatchCost:
        lru = self._lru
        hits = 0
        computed = 0
        for item in blocks:
            hitting = True
            for h, t in item:
                if h < 0:  # a pooled item's input: never cached
                    computed += t
                    hitting = False
                    continue
                if hitting and h in lru:
                    lru.move_to_end(h)
                    hits += 1
                    continue
                hitting = False
                computed += t
                if t <= self.cache_tokens:
                    if h not in lru:
                        self._lru_tokens += t
                    lru[h] = t
                    lru.move_to_end(h)
                    while self._lru_tokens > self.cache_tokens:
                        self._lru_tokens -= lru.popitem(last=False)[1]
        return BatchCost(items=len(blocks), input_tokens=sum(lengths), computed_tokens=computed, padded_tokens=0,
                         rect_tokens=0, prefix_tokens=0, hit_blocks=hits,
                         queried_blocks=sum(len(b) for b in blocks), seconds=0.0)


class Sim(StreamingRun):
    """The simulated engine behind the streaming interface (`base.py`): it hashes each added group's
    tokens into blocks and "generates" max_new_tokens deterministic token ids per item (a function
    of the item's id and of its prompt's tokens: `generated`), so results can be checked end to end.

    - `packed`: a continuous-batching engine (`continuous.ContinuousSim`): up to max_batch_size
      sequences run, each step decodes one token of each and prefills new items within
      max_batch_tokens; an item's result is ready at the step it finishes.
    - `padded`: each added group is one rectangle (`SimEngine.run`), run in order; every item of
      it is ready when the rectangle is.

    Time: modeled seconds. Unpaced (`pace_seconds` 0) a poll computes until an item is ready and reports
    the modeled seconds, spending none. Paced, an item is handed back when the wall clock reaches its
    modeled finish x pace_seconds (from when the engine last became busy), so consumers of different
    sizes split the work as real cards would. `zero_cost` hands everything back at once, reading no
    prompt (outputs of digest 0): a benchmark measures the broker. `start_seconds`: the constructor
    takes that long. Request options: `sim_requests.py`; vectors (`task = "embed"`): `sim_embed.py`."""

    VOCAB = 32_000

    def __init__(self, settings, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, contract=None, **_options):
        time.sleep(float(getattr(settings, "start_seconds", 0.0)))  # a model loading (`SimSettings.start_seconds`)
        self.mode = as_mode(settings.mode, "sim engine mode")
        self.block_tokens = block_tokens
        self.pace = float(getattr(settings, "pace_seconds", 0.0))
        self.cost = settings.cost
        self.model = SimEngine(settings.mode, cache_tokens=settings.cache_tokens, block_tokens=self.block_tokens,
                               cost=settings.cost)
        self.contract = contract
        self.stream = None
        if self.mode == Mode.PACKED and not self.cost.zero_cost:
            from .continuous import ContinuousSim

            bs = contract.max_batch_size if contract is not None else 1 << 20
            bt = contract.max_batch_tokens if contract is not None else 1 << 40
            self.stream = ContinuousSim(bs, bt, settings.cache_tokens, settings.cost)
        self._groups: deque = deque()  # padded: (ids, max_new, shapes) not run yet
        self._ready: list = []  # (modeled finish, ids, max_new, cached tokens or None) computed, not handed back
        self._seqs: dict[int, tuple[int, int]] = {}  # packed: sequence key -> (item id, max_new_tokens)
        self._num_seqs = self._pending = 0
        self.clock = 0.0  # modeled seconds computed
        self._origin = 0.0  # wall time (monotonic) of modeled 0 for a paced engine
        self._figures = CacheFigures()  # since the last poll
        self.faults = SimFaults.of(settings)  # faults.py: None unless a test asks for one
        self._digests: dict[int, tuple[int, int]] = {}  # item id in flight -> (prompt digest, times in flight)
        self._sampled: dict[int, object] = {}  # item id in flight -> (its tokens, extras), or its vector's words
        tokenizer = getattr(settings, "tokenizer", None)
        self.structured = StructuredText(tokenizer) if tokenizer else None  # constrained outputs as text
        self.embedder = SimEmbedder(settings) if embeds(settings) else None  # vectors (sim_embed.py)
        self.unhonoured = self.embedder.unhonoured if self.embedder is not None else ()

    def pending(self) -> int:  # items added and not handed back
        return self._pending

    def add(self, batch) -> None:
        if self.faults is not None:
            batch = self.faults.added_batch(batch)
        n = len(batch)
        if not n:
            return
        ids = np.asarray(batch.item_ids, np.uint64)
        max_new = np.asarray(batch.max_new_tokens, np.int64)
        if not self.cost.zero_cost:  # zero cost reads no prompt (outputs of digest 0): it measures the broker
            self._remember(ids, batch.tokens)
        if self.embedder is not None:  # each item's vector is its result; prefill only
            self._sampled.update(self.embedder.results(ids, batch))
            max_new = np.zeros(n, np.int64)
        elif batch.options is not None and not self.cost.zero_cost:
            max_new = self._sample(ids, batch, max_new)
        if self._pending == 0 and not self._ready:
            # idle until now: the modeled clock resumes at the wall clock
            self._origin = time.monotonic() - self.clock * self.pace
        self._pending += n
        if self.cost.zero_cost:
            self._ready.append((self.clock, ids, max_new, None))
            return
        lengths = np.array([t.size for t in batch.tokens], np.int64)
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate(batch.tokens) if n else np.zeros(0, np.uint32)
        shapes = shape_items(flat, offsets, block_tokens=self.block_tokens)
        if self.stream is None:
            self._groups.append((ids, max_new, shapes))
            return
        for k in range(n):  # each sequence its own key: the same item added twice runs twice
            self._num_seqs += 1
            self._seqs[self._num_seqs] = (int(ids[k]), int(max_new[k]))
            self.stream.add(self._num_seqs, shapes.sized_blocks(k), int(lengths[k]), max(1, int(max_new[k])))

    def _compute_one(self) -> bool:
        """Compute the next step (packed) or rectangle (padded); False when nothing is left."""
        if self.stream is not None:
            if self.stream.idle:
                return False
            h0, q0 = self.stream.hit_blocks, self.stream.queried_blocks
            seconds, keys = self.stream.step()
            self.clock += seconds
            self._figures.hit_blocks += self.stream.hit_blocks - h0
            self._figures.queried_blocks += self.stream.queried_blocks - q0
            if keys:
                done = [self._seqs.pop(k) for k in keys]
                self._ready.append((self.clock, np.array([i for i, _ in done], np.uint64),
                                    np.array([m for _, m in done], np.int64),
                                    np.array([self.stream.last_cached[k] for k in keys], np.int64)))
            return True
        if not self._groups:
            return False
        ids, max_new, shapes = self._groups.popleft()
        cost = self.model.run(shapes, np.arange(len(ids)), max_new)
        self.clock += cost.seconds
        f = self._figures
        f.hit_blocks += cost.hit_blocks
        f.queried_blocks += cost.queried_blocks
        f.padded_tokens += cost.padded_tokens
        f.rect_tokens += cost.rect_tokens
        self._ready.append((self.clock, ids, max_new, None))
        return True

    def poll(self, timeout_seconds: float) -> EngineOutcome:
        if self.faults is not None:
            self.faults.polled()
        deadline = time.monotonic() + max(0.0, timeout_seconds)
        start_clock = self.clock
        while not self._ready and self._compute_one():
            pass
        out = []
        while True:
            while self._ready and self._due(self._ready[0][0]) <= time.monotonic():
                out.append(self._ready.pop(0))
            if out or not self._ready:
                break
            wait = min(self._due(self._ready[0][0]), deadline) - time.monotonic()
            if wait <= 0:
                break
            time.sleep(wait)
        f, self._figures = self._figures, CacheFigures()
        seconds = self.clock - start_clock
        if not out:
            return EngineOutcome([], f.hit_blocks, f.queried_blocks, seconds, f.padded_tokens, f.rect_tokens)
        ids = np.concatenate([o[1] for o in out])
        max_new = np.concatenate([o[2] for o in out])
        self._pending -= ids.size
        digests = np.zeros(ids.size, np.uint32) if self.cost.zero_cost else self._recall(ids)
        if self.embedder is not None:  # the vectors as columns (an item in flight twice keeps its own)
            res = self.embedder.batch(ids, self._sampled, self._digests)
        elif self._sampled and not self._sampled.keys().isdisjoint(ids.tolist()):
            res = self._with_samples(self.generated_many(ids, max_new, digests))
        else:
            res = self.generated_many(ids, max_new, digests)
        if self.embedder is None and all(o[3] is not None for o in out):  # a packed engine says what it cached
            with_cached(res, np.concatenate([o[3] for o in out]))
        return EngineOutcome(res, f.hit_blocks, f.queried_blocks, seconds, f.padded_tokens, f.rect_tokens)

    def _with_samples(self, res: BatchResults) -> BatchResults:
        """The results of items with options replaced by their samples (each forgotten with the last
        copy of its item in flight)."""
        items = res.items()
        for r in items:
            got = self._sampled.get(r.item_id)
            if got is not None:
                r.tokens, r.extras = got
                if r.item_id not in self._digests:
                    del self._sampled[r.item_id]
        return BatchResults.of(items)

    def _sample(self, ids: np.ndarray, batch, max_new: np.ndarray) -> np.ndarray:
        """The items' results under their options (`sim_requests.py`), noted for their poll; the
        modeled output lengths (an item with samples runs until its longest ends)."""
        max_new = max_new.copy()
        for k, opts in enumerate(batch.options):
            if opts is None or unmodeled(opts, self.structured):
                continue
            item = int(ids[k])
            key = sample_key(item, self.digest(batch.tokens[k]), opts)
            one = np.array([item], np.uint64)
            if opts.structured is not None and self.structured is not None and self.structured.models(opts.structured):
                tokens, extras = self.structured.result(opts.structured, key, int(max_new[k]), opts)
            else:
                tokens, extras = sampled_result(item, key, int(max_new[k]), opts, lambda keys, counts: self.generated_many(
                    np.repeat(one, keys.size), counts, keys=keys).flat)
            self._sampled[item] = (tokens, extras)
            max_new[k] = max(decode_extras(extras, tokens.size).lengths)
        return max_new

    def _due(self, clock: float) -> float:  # the wall time of a modeled clock reading
        return self._origin + clock * self.pace if self.pace else 0.0

    def _remember(self, ids: np.ndarray, tokens) -> None:
        """Note the prompt digest of each item added (an item may be in flight twice)."""
        digests = self._digests
        for i, t in zip(ids.tolist(), tokens):
            held = digests.get(i)
            digests[i] = (self.digest(t), 1) if held is None else (held[0], held[1] + 1)

    def _recall(self, ids: np.ndarray) -> np.ndarray:
        """The prompt digests of items finished (each forgotten once no copy of it is in flight)."""
        digests = self._digests
        out = np.empty(ids.size, np.uint32)
        for k, i in enumerate(ids.tolist()):
            digest, times = digests.pop(i)
            out[k] = digest
            if times > 1:
                digests[i] = (digest, times - 1)
        return out

    @staticmethod
    def digest(tokens) -> int:
        """What of a prompt its generated tokens depend on: crc32c of its token ids (uint32, little-endian)."""
        return crc32c.crc32c(np.ascontiguousarray(tokens, np.uint32))

    @classmethod
    def generated(cls, item_id: int, count: int, tokens) -> np.ndarray:
        """An item's `count` generated ids, from its id and its prompt's `digest` (damaged input: other ids)."""
        return cls.generated_many(np.array([item_id], np.uint64), np.array([count], np.int64), np.array([cls.digest(tokens)], np.uint32)).flat

    @classmethod
    def generated_many(cls, item_ids: np.ndarray, counts: np.ndarray, digests: np.ndarray | None = None, *,
                       keys: np.ndarray | None = None) -> BatchResults:
        """`generated` for many items at once, as columns (`digests`: each prompt's `digest`; or each
        item's `keys`, `sim_requests.py`, for items with request options)."""
        counts = np.asarray(counts, np.int64)
        offsets = np.zeros(counts.size + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        steps = (np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)).astype(np.uint64)
        keys = item_keys(item_ids, digests) if keys is None else keys
        z = np.repeat(keys, counts) + steps * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer per step
        z ^= z >> np.uint64(31)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(29)
        flat = (z % np.uint64(cls.VOCAB)).astype(np.uint32)
        return BatchResults(np.asarray(item_ids, np.uint64), np.zeros(counts.size, np.uint32), flat, offsets)

    def close(self) -> None:
        pass
