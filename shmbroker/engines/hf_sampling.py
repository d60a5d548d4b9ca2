"""How the `hf` engine decodes its rows under their items' request options: which token each row
takes next, when it stops, and the samples each item gets back.

Rows. An item asking for n samples decodes n rows: its prompt is prefilled once (one rectangle row,
as without options) and its KV rows repeated after the prefill (`rows_of`), so n costs decode
steps, not prefill. Items with different options share the rectangle and every forward pass: only
the choice of the next token differs per row, and it is made on the logits, row by row.

The choice is transformers' own, with the logits processors `generate` builds for the same
arguments, in `generate`'s order:
- no options (and temperature 0 or none, the broker's default): greedy, argmax of the logits, exactly
  as the engine always decoded;
- `repetition_penalty` (RepetitionPenaltyLogitsProcessor over the row's prompt and output, as
  generate's `repetition_penalty`), then `min_tokens` (generate's `min_new_tokens`: the row's stop
  ids, EOS included unless ignore_eos, cannot be drawn until that many tokens are out);
- a temperature above 0 samples (generate's `do_sample=True`): TemperatureLogitsWarper, then
  TopKLogitsWarper (`top_k` above 0), TopPLogitsWarper (`top_p` below 1), MinPLogitsWarper
  (`min_p` above 0), then one draw from the softmax (`torch.multinomial`); greedy with options is
  the argmax of the penalised logits;
- `seed`: generate has no per-row seed (it draws from the global generator), so a seeded item gets
  its own `torch.Generator`, seeded with it, from which its rows draw, step by step, in row order.
  Its draws then depend on its own logits alone, not on what else shares the batch or in which
  order: two runs of the item, in different batches, give the same samples where its logits are
  the same numbers (float64: batched and alone differ by ~1e-15; bf16 on a GPU: as reproducible as
  greedy decoding is there). An unseeded sampled row draws from torch's global generator.
A row stops on its stop ids (the model's EOS ids unless `ignore_eos`, and `stop_token_ids`: generate's
`eos_token_id` list), kept as its last token, or on a `stop` string (StopStringCriteria, generate's
`stop_strings`, matched in the row's output with the model directory's tokenizer; the engine has none
without one and does not honour `stop` then), once `min_tokens` are out; else at its max_new_tokens.
transformers has no presence or frequency penalty: the engine does not honour them.
A row under a constraint (`grammars.py`) has its logits masked by its grammar's xgrammar logits
processor, after the penalty and min_tokens and before the sampling warpers (where `generate` puts a
`logits_processor` it is given), and ends when its grammar does (on the grammar's stop ids, kept).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class Sampled(NamedTuple):
    """One item's output: its samples' tokens and whether each ended on a stop (not its length)."""

    samples: list
    stopped: list


def rows_of(options, n: int) -> np.ndarray:
    """The item each decode row belongs to: n samples, n rows (None: one row per item)."""
    counts = [1 if o is None else o.samples for o in (options or [None] * n)]
    return np.repeat(np.arange(n), counts)


def stop_ids(opts, eos) -> set:
    """The ids that end a row: the model's EOS ids unless ignore_eos, and its stop_token_ids."""
    if opts is None:
        return set(eos)
    return (set() if opts.ignore_eos else set(eos)) | set(opts.stop_token_ids or ())


class OptionGroup:
    """The rows of one option set: what processes their logits, and how they draw."""

    def __init__(self, opts, rows: list, items: list, *, eos, vocab: int, device, criteria=None, grammar=None):
        self.opts = opts
        self.grammar = grammar  # its constraint's xgrammar logits processor, or None
        self.rows = torch.as_tensor(rows, device=device)
        self.row_list = rows
        penalty = opts.repetition_penalty
        self.penalty = None if penalty in (None, 1.0) else RepetitionPenaltyLogitsProcessor(penalty)
        self.min_tokens = opts.min_tokens or 0
        blocked = sorted(t for t in stop_ids(opts, eos) if t < vocab)
        self.blocked = torch.as_tensor(blocked, device=device) if self.min_tokens and blocked else None
        self.criteria = criteria  # StopStringCriteria of its stop strings, or None
        self.warpers = [] if opts.greedy else warpers(opts)
        if opts.seed is None or opts.greedy:
            self.draws = [(torch.arange(len(rows), device=device), None)]
        else:  # one generator per item (module docstring), its rows drawn in order
            self.draws = []
            for item in dict.fromkeys(items):
                gen = torch.Generator(device=device)
                gen.manual_seed(opts.seed)
                local = [k for k, i in enumerate(items) if i == item]
                self.draws.append((torch.as_tensor(local, device=device), gen))

    def pick(self, scores: torch.Tensor, ids, out, step: int) -> torch.Tensor:
        """The rows' next tokens from their (float) logits; `ids`: their prompt and output so far,
        `out`: their output so far (what the grammar's processor reads its rows' last tokens from)."""
        if self.penalty is not None:
            scores = self.penalty(ids, scores)
        if self.grammar is not None:
            scores = self.grammar(out, scores)
        if self.blocked is not None and step < self.min_tokens:
            scores = self._block(scores)
        if not self.warpers:
            return scores.argmax(-1)
        for warp in self.warpers:
            scores = warp(None, scores)
        probs = torch.softmax(scores, dim=-1)
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        for local, gen in self.draws:
            out[local] = torch.multinomial(probs[local], 1, generator=gen).squeeze(1)
        return out

    def _block(self, scores: torch.Tensor) -> torch.Tensor:
        """min_tokens: the stop ids cannot be drawn yet, except by a row whose grammar allows nothing
        else (its grammar is finished: the row ends there)."""
        blocked = scores.index_fill(1, self.blocked, float("-inf"))
        if self.grammar is None:
            return blocked
        closed = (blocked == float("-inf")).all(-1, keepdim=True)
        return torch.where(closed, scores, blocked)


def warpers(opts) -> list:
    """generate's sampling warpers for these options, in its order."""
    out = [TemperatureLogitsWarper(float(opts.temperature))]
    if opts.top_k is not None and opts.top_k > 0:
        out.append(TopKLogitsWarper(int(opts.top_k)))
    if opts.top_p is not None and opts.top_p < 1.0:
        out.append(TopPLogitsWarper(float(opts.top_p)))
    if opts.min_p:
        out.append(MinPLogitsWarper(float(opts.min_p)))
    return out


class Decoder:
    """The rows of one rectangle under their items' options: `pick` their next tokens from the
    logits, `take` them (True once every row is done), `items` the items' samples. `criteria(stop)`:
    the StopStringCriteria of stop strings; `grammar(structured)`: (a logits processor of the
    constraint, the ids that end its rows)."""

    def __init__(self, tokens, max_new, options, *, eos, vocab: int, device, criteria=None, grammar=None):
        self.n = len(tokens)
        self.row_item = rows_of(options, self.n)
        opts = [None if options is None else options[i] for i in self.row_item.tolist()]
        self.max_new = [int(max_new[i]) for i in self.row_item.tolist()]
        self.stops = [stop_ids(o, eos) for o in opts]
        self.min_tokens = [0 if o is None else o.min_tokens or 0 for o in opts]
        self.generated: list[list[int]] = [[] for _ in opts]
        self.stopped = [False] * len(opts)
        self.done = [m <= 0 for m in self.max_new]
        self.ends = [frozenset()] * len(opts)  # a constrained row's grammar stop ids: they end it
        self.groups = []
        for o in dict.fromkeys(o for o in opts if o is not None):
            rows = [r for r, x in enumerate(opts) if x == o]
            processor = None
            if o.structured is not None:
                if grammar is None:
                    raise ValueError("a constraint needs the model directory's tokenizer and xgrammar")
                processor, ends = grammar(o.structured)
                for r in rows:
                    self.ends[r] = ends
            self.groups.append(OptionGroup(o, rows, [int(self.row_item[r]) for r in rows], eos=eos, vocab=vocab,
                                           device=device, criteria=criteria(o.stop) if o.stop and criteria else None,
                                           grammar=processor))
        self.device = device
        self._prompts = None  # the rows' prompts padded with `vocab` (no token), for a repetition penalty
        if any(g.penalty is not None for g in self.groups):
            width = max(int(t.size) for t in tokens)
            padded = np.full((self.n, width), vocab, np.int64)
            for i, t in enumerate(tokens):
                padded[i, : t.size] = t
            self._prompts = torch.as_tensor(padded[self.row_item], device=device)
        keep = self._prompts is not None or any(g.criteria is not None or g.grammar is not None for g in self.groups)
        self._out = torch.zeros((len(opts), 0), dtype=torch.long, device=device) if keep else None

    @property
    def expanded(self) -> bool:
        """Does any item decode more than one row?"""
        return self.row_item.size != self.n

    def pick(self, logits: torch.Tensor, step: int) -> list[int]:
        if not self.groups:
            return logits.float().argmax(-1).tolist()
        scores = logits.float()
        nxt = scores.argmax(-1)
        for g in self.groups:
            out = None if self._out is None else self._out[g.rows]
            ids = None if self._prompts is None else torch.cat([self._prompts[g.rows], out], 1)
            nxt[g.rows] = g.pick(scores[g.rows], ids, out, step)
        return nxt.tolist()

    def take(self, nxt: list[int], step: int) -> bool:
        """Append each live row's token (the `step`-th) and see which rows are done."""
        live = [r for r, d in enumerate(self.done) if not d]
        for r in live:
            self.generated[r].append(int(nxt[r]))
            if nxt[r] in self.ends[r] or (nxt[r] in self.stops[r] and step + 1 >= self.min_tokens[r]):
                self.stopped[r] = True
        if self._out is not None:
            self._out = torch.cat([self._out, torch.as_tensor(nxt, device=self.device)[:, None]], 1)
            for g in self.groups:
                if g.criteria is not None and step + 1 >= g.min_tokens:
                    hits = g.criteria(self._out[g.rows], None).tolist()
                    for r, hit in zip(g.row_list, hits):
                        self.stopped[r] = self.stopped[r] or (hit and not self.done[r])
        for r in live:
            self.done[r] = self.stopped[r] or len(self.generated[r]) >= self.max_new[r]
        return all(self.done)

    def items(self) -> list[Sampled]:
        out = [Sampled([], []) for _ in range(self.n)]
        for r, i in enumerate(self.row_item.tolist()):
            out[i].samples.append(self.generated[r])
            out[i].stopped.append(self.stopped[r])
        return out
