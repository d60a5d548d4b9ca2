"""`hf`: transformers on torch, a padded engine that computes a shape-pure batch's shared prefix once.

A batch from the broker is shape-pure: one prefix family, similar lengths (or a loose rectangle of
several families whose own rectangles would not pay for their padding, `pack/loose.py`: similar
input and output lengths, and a common prefix only as long as its rows happen to share). This
engine turns that into compute saved:

1. the batch's common prefix (`EngineBatch.prefix_tokens`, at least one token of every item left
   outside it) runs once, batch size 1, into a KV cache (`DynamicCache`);
2. if the previous batch's prefix shares a start with it (the same family again: the scheduler
   keeps a consumer on a family), that much of the kept cache is reused (cropped), and only the
   rest of the prefix is computed: the hits reported;
3. the prefix cache is repeated for the batch, and the suffixes run as one right-padded rectangle
   (count × longest suffix: the padding reported) with explicit position ids and an attention mask
   that hides the pads;
4. decoding, greedy unless an item's request options say otherwise (`hf_sampling.py`: transformers'
   own logits processors, a seeded item drawing from a generator of its own, n samples as n decode
   rows after one prefill, stop ids and strings): `max_new_tokens` per item honoured, an item stops
   at the model's EOS (kept as its last token); finished rows ride along masked until the longest
   is done. Items with different options share the rectangle and every forward pass: only the
   choice of each row's next token differs, so nothing is split. Each result carries its samples,
   their finish reasons (stop or length) and the prompt tokens served from a cache (the first item
   the kept prefix's, every other the shared prefix) as extras.

Request options honoured: temperature, top_p, top_k, min_p, seed, stop_token_ids, n,
repetition_penalty, min_tokens, ignore_eos, and, when the model directory holds a tokenizer, `stop`
strings (transformers matches them in text) and `structured` (a constraint, masked by xgrammar's
logits processor on its rows alone: `grammars.py`; one xgrammar cannot compile fails its item
alone, `invalid`, and the others run); not presence or frequency penalties (transformers has none).
The packer is not yet told about samples: it sizes a batch by its items, and an item asking for n
decodes n rows (its KV rows repeated), so a batch of such items holds more sequences, and more KV,
than its count says (an item asking for more samples than `max_batch_size` fails alone).

The prefix's KV is kept for the next batch (`keep_prefix`). With `reuse_prefix = false` the engine
runs plain right-padded batches (what FIFO feeding gets; `bench gpu` compares the two).

Weights: a local directory (`model`, loaded with `local_files_only`: never downloaded), or a
transformers config (`config`) built with random weights from `seed` (benchmarks, tests). bf16 on
CUDA, fp32 on the CPU unless `dtype` says otherwise. A consumer that embeds (`task = "embed"`) gets
an encoder instead (`HF(settings)` returns an `hf_embed.HFEmbed`): no decoding, one vector an item.

Failures (judged by `BatchStream`, engines/batch_stream.py, with engines/deaths.py): a batch that raises is
run item by item. An item the model cannot take (a token id outside its vocabulary, longer than its
positions) raises alone and fails alone, once a one-token probe batch shows the engine still answers.
torch reports a lost CUDA context (an illegal memory access, a device-side assert: every later call
fails too) as a RuntimeError or torch.AcceleratorError in those words: the engine is dead
(`EngineDead`), no item fails, and the GPU process starts afresh; so it is after ENGINE_FAILURES_MAX
failures in a row with no success between. `torch.OutOfMemoryError` is not death: the items alone
are smaller work.
"""

from __future__ import annotations

import copy
import inspect
import time

import numpy as np
import torch
import transformers

from ..pack.contract import Mode
from ..pack.shapes import DEFAULT_BLOCK_TOKENS
from ..request.extras import encode_extras
from .base import INVALID, BatchResults, EngineOutcome, ItemResult, merge_outcomes
from .batch_stream import answered
from .hf_sampling import Decoder, Sampled
from .grammars import Grammars, available
from .options import embeds
from .packed_args import has_tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
CRITERIA_KEPT = 64  # distinct stop-string sets whose StopStringCriteria the engine keeps built


class HF:
    mode = Mode.PADDED

    def __new__(cls, settings=None, **options):
        """An encoder (`hf_embed.HFEmbed`) where the consumer embeds (`task = "embed"`), else this engine
        (without settings too: `copy.copy` makes its copy so)."""
        if settings is not None and embeds(settings):
            from .hf_embed import HFEmbed

            return HFEmbed(settings, **options)
        return super().__new__(cls)

    def __init__(self, settings, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, contract=None, **_options):
        self.settings = settings
        self.block_tokens = block_tokens
        self.device, self.dtype = placement(settings)
        self.model = build_model(settings, self.dtype).to(self.device).eval()
        # transformers renamed forward's `past_key_values` to `cache` (5.x deprecates the old name)
        self._kv = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos = set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
        self._kept: tuple[np.ndarray, object] | None = None  # the last prefix's tokens and its KV (batch 1)
        # stop strings are matched in text, constraints compiled against the vocabulary: without a
        # tokenizer in the model directory the engine honours neither (nor constraints without xgrammar)
        self.tokenizer = load_tokenizer(settings.model)
        has_xgrammar = self.tokenizer is not None and available()
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos) if has_xgrammar else None
        self.unhonoured = ({"stop"} if self.tokenizer is None else set()) | ({"structured"} if self.grammars is None else set())
        self._criteria: dict = {}  # stop strings -> their StopStringCriteria
        params = inspect.signature(self.model.forward).parameters
        # logits of the positions that are read only (a batch's full logits are count x width x vocab)
        self._keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        # sliding-window attention masks by cache column, not position: a right-padded item would see
        # fewer real tokens in its window while it decodes, so such a model runs its suffixes unpadded
        layer_types = getattr(cfg, "layer_types", None) or ()
        self.sliding = "sliding_attention" in layer_types or (
            bool(getattr(cfg, "sliding_window", None)) and getattr(cfg, "use_sliding_window", True) is not False)

    # -- a batch -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch) -> EngineOutcome:
        refused = self._uncompilable(batch)
        if refused:  # those items fail alone; the others run
            failed = EngineOutcome([ItemResult(int(batch.item_ids[k]), INVALID, error=e) for k, e in refused.items()])
            keep = [k for k in range(len(batch)) if k not in refused]
            out = answered(batch, merge_outcomes([self.run(batch.rows(keep)), failed]) if keep else failed)
            out.results = BatchResults.of(out.results)  # in the batch's order, as a batch's results are
            return out
        t0 = time.perf_counter()
        tokens = [np.asarray(t) for t in batch.tokens]
        n = len(tokens)
        max_new = [int(m) for m in batch.max_new_tokens]  # 0: prefill only, no token generated
        for t, m in zip(tokens, max_new):
            self._check(t, m)
        lengths = [int(t.size) for t in tokens]
        prefix = 0
        if self.settings.reuse_prefix:
            prefix = min(batch.prefix_tokens, min(lengths) - 1)
        cache, cached = self._prefix_cache(tokens[0][:prefix]) if prefix > 0 else (None, 0)
        opts = batch.options
        if self.sliding and n > 1:  # one suffix at a time on the shared prefix: no padding at all
            generated = [self.generate([t], [x], prefix, copy.deepcopy(cache), [m], None if opts is None else [opts[i]])[0]
                         for i, (t, x, m) in enumerate(zip(tokens, lengths, max_new))]
            rect = sum(x - prefix for x in lengths)
        else:
            generated = self.generate(tokens, lengths, prefix, cache, max_new, opts)
            rect = n * max(lengths[i] - prefix for i in range(n))
        padded = rect - sum(lengths[i] - prefix for i in range(n))
        b = self.block_tokens
        hit_blocks = n * (cached // b) + (n - 1) * (prefix // b - cached // b) if prefix else 0
        # each item's prompt tokens served from a cache: the first item's from the kept prefix, the
        # others' the whole shared prefix (computed once for the batch)
        served = [cached if i == 0 else prefix for i in range(n)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return EngineOutcome(results_of(batch.item_ids, generated, served), hit_blocks=hit_blocks,
                             queried_blocks=sum(x // b for x in lengths), engine_seconds=time.perf_counter() - t0,
                             padded_tokens=padded, rect_tokens=rect, reused_tokens=sum(served))

    def _uncompilable(self, batch) -> dict:
        """The items whose constraint cannot be compiled: position -> why (the rest are compiled now,
        each distinct constraint once per engine)."""
        out = {}
        for k, o in enumerate(batch.options or ()):
            if o is None or o.structured is None:
                continue
            if self.grammars is None:
                out[k] = "constraints need the model directory's tokenizer and xgrammar"
            elif (why := self.grammars.error(o.structured)) is not None:
                out[k] = why
        return out

    def _check(self, tokens: np.ndarray, max_new: int) -> None:
        if tokens.size == 0:
            raise ValueError("no tokens")
        top = int(tokens.max())
        if top >= self.vocab_size:
            raise ValueError(f"token id {top} is outside the model's vocabulary ({self.vocab_size})")
        if tokens.size + max_new > self.max_positions:
            raise ValueError(f"{tokens.size} tokens + {max_new} new exceed the model's {self.max_positions} positions")

    def _prefix_cache(self, prefix: np.ndarray):
        """(the prefix's KV cache at batch size 1, for this batch to expand; prefix tokens it took from
        the kept cache). The kept cache is extended in place and kept again: one copy a batch."""
        cached = 0
        cache = None
        kept, self._kept = self._kept, None
        if kept is not None and self.settings.keep_prefix:
            old, old_cache = kept
            m = min(old.size, prefix.size)
            diff = np.flatnonzero(old[:m] != prefix[:m])
            cached = int(diff[0]) if diff.size else m
            if cached:
                cache = old_cache
                if cached < old.size:
                    cache.crop(cached - old.size)  # negative: drop that many (every release takes it)
        if cache is None:
            cache = transformers.DynamicCache()
            cached = 0
        if cached < prefix.size:
            ids = torch.as_tensor(prefix[cached:].astype(np.int64), device=self.device)[None]
            pos = torch.arange(cached, prefix.size, device=self.device)[None]
            self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._kv: cache}, **self._logits(1))
        if self.settings.keep_prefix:
            self._kept = (prefix.copy(), cache)
            return copy.deepcopy(cache), cached
        return cache, cached

    def generate(self, tokens, lengths, prefix: int, cache, max_new, options=None) -> list[Sampled]:
        """The items' samples: the suffixes prefilled as one right-padded rectangle on the prefix's KV,
        then each row decoded under its item's options (`hf_sampling.py`)."""
        dev = self.device
        logits, mask_t, cache = self._prefill(tokens, lengths, prefix, cache)
        ends = torch.as_tensor(lengths, device=dev)
        dec = Decoder(tokens, max_new, options, eos=self.eos, vocab=self.vocab_size, device=dev,
                      criteria=self._stop_criteria, grammar=None if self.grammars is None else self.grammars.processor)
        if dec.expanded:  # an item's n samples: its KV rows repeated after its one prefill
            rows = torch.as_tensor(dec.row_item, device=dev)
            cache.batch_select_indices(rows)
            mask_t, ends, logits = mask_t[rows], ends[rows], logits[rows]
        count = len(dec.max_new)
        for step in range(max(dec.max_new)):
            nxt = dec.pick(logits, step)
            if dec.take(nxt, step):
                break
            mask_t = torch.cat([mask_t, torch.ones((count, 1), dtype=mask_t.dtype, device=dev)], dim=1)
            step_ids = torch.as_tensor(nxt, device=dev)[:, None]
            out = self.model(input_ids=step_ids, attention_mask=mask_t, position_ids=(ends + step)[:, None],
                             use_cache=True, **{self._kv: cache})
            logits = out.logits[:, -1]
        return dec.items()

    def _prefill(self, tokens, lengths, prefix: int, cache):
        """(each item's last logits, the attention mask, the cache) after the suffixes' rectangle."""
        n = len(tokens)
        dev = self.device
        width = max(lengths) - prefix
        ids = np.zeros((n, width), np.int64)
        mask = np.zeros((n, prefix + width), np.int64)
        mask[:, :prefix] = 1
        for i, t in enumerate(tokens):
            ids[i, : lengths[i] - prefix] = t[prefix:]
            mask[i, prefix : lengths[i]] = 1
        if cache is not None and prefix > 0:
            cache.batch_repeat_interleave(n)
        elif cache is None:
            cache = transformers.DynamicCache()
        mask_t = torch.as_tensor(mask, device=dev)
        pos = torch.arange(prefix, prefix + width, device=dev)[None].expand(n, width)
        last = [x - prefix - 1 for x in lengths]
        keep = width - min(last)  # the logits kept: from the earliest last position to the end
        out = self.model(input_ids=torch.as_tensor(ids, device=dev), attention_mask=mask_t, position_ids=pos,
                         use_cache=True, **{self._kv: cache}, **self._logits(keep))
        kept = out.logits.shape[1]
        logits = out.logits[torch.arange(n, device=dev), torch.as_tensor(last, device=dev) - (width - kept)]
        return logits, mask_t, cache

    def _stop_criteria(self, stop: tuple):
        """transformers' StopStringCriteria for these stop strings with the model's tokenizer (kept:
        building one reads the whole vocabulary)."""
        got = self._criteria.get(stop)
        if got is None:
            if len(self._criteria) >= CRITERIA_KEPT:
                self._criteria.clear()
            got = self._criteria[stop] = transformers.StopStringCriteria(self.tokenizer, list(stop))
        return got

    def _logits(self, keep: int) -> dict:
        return {self._keep: keep} if self._keep else {}

    def forget_prefix(self) -> None:
        """Drop the kept prefix's KV: the next batch computes its prefix whole (benchmarks' runs start
        equal)."""
        self._kept = None

    def close(self) -> None:
        self._kept = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def placement(settings) -> tuple:
    """(torch device, torch dtype) of the settings, with the CPU threads set: `auto` is cuda when torch
    sees a GPU, bf16 on CUDA and fp32 on the CPU."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    return torch.device(device), DTYPES[dtype]


def dtype_argument(dtype) -> dict:
    """`from_pretrained`'s dtype keyword: transformers >= 4.56 takes `dtype`, older releases `torch_dtype`."""
    key = "dtype" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"
    return {key: dtype}


def build_model(settings, dtype, auto=None):
    """The model (`auto`: a transformers Auto class, the causal LM's by default): from a local
    directory (never downloaded), or random weights from a config table."""
    auto = auto or transformers.AutoModelForCausalLM
    if settings.model:
        return auto.from_pretrained(settings.model, local_files_only=True, attn_implementation=settings.attn_implementation,
                                    **dtype_argument(dtype))
    raw = dict(settings.config)
    model_type = raw.pop("model_type", "llama")
    config = transformers.AutoConfig.for_model(model_type, **raw)
    torch.manual_seed(settings.seed)
    return auto.from_config(config, attn_implementation=settings.attn_implementation, **dtype_argument(dtype))


def alone(engine: HF, tokens: np.ndarray, max_new_tokens: int, options=None) -> Sampled:
    """One item alone, no prefix reuse, no kept cache: the reference a batch's outputs must equal."""
    cache = transformers.DynamicCache()
    tokens = np.asarray(tokens)
    with torch.inference_mode():
        return engine.generate([tokens], [int(tokens.size)], 0, cache, [int(max_new_tokens)],
                                None if options is None else [options])[0]


def unbatched(engine: HF, tokens: np.ndarray, max_new_tokens: int, options=None) -> list[int]:
    """`alone`'s first sample."""
    return alone(engine, tokens, max_new_tokens, options).samples[0]


def results_of(item_ids, generated: list[Sampled], served: list[int]) -> BatchResults:
    """The items' results: their samples one after another, with their lengths, finish reasons and
    the prompt tokens served from a cache as extras."""
    n = len(generated)
    flat = [t for g in generated for s in g.samples for t in s]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([sum(len(s) for s in g.samples) for g in generated], out=offsets[1:])
    extras = {i: encode_extras([len(s) for s in g.samples], g.stopped, served[i]) for i, g in enumerate(generated)}
    return BatchResults(np.asarray(item_ids, np.uint64), np.zeros(n, np.uint32), np.asarray(flat, np.uint32),
                        offsets, extras=extras)


def load_tokenizer(model):
    """The model directory's tokenizer (for stop strings and constraints), or None: none there, or it does not load."""
    if not model or not has_tokenizer(model):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer: the engine does not honour stop strings or constraints
        return None
