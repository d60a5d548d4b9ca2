"""`hf` with `task = "embed"`: an encoder's vectors, one forward per rectangle.

The broker's padded packer hands the engine shape-pure rectangles (items of similar lengths); each
runs as one right-padded forward with an attention mask that hides the pads, and each item's vector
comes back with `vector_result`. An encoder attends both ways, so nothing of a shared prefix is
computed once: the rectangle is count x longest whole input, its padding reported. Two kinds of
model:

- a sentence-transformers directory (it holds `modules.json`): its own module stack (Transformer,
  then Pooling, Normalize, Dense, ... as the directory says) runs on the broker's token ids: the
  features `input_ids`, `attention_mask` (and zero `token_type_ids` where the model takes them)
  through the stack's forward, `sentence_embedding` read. Nothing is tokenized again: the ids are
  what the model's tokenizer made on the producer's side. An item longer than the directory's
  `max_seq_length` fails alone (sentence-transformers would cut it without a word);
- a plain transformers encoder (AutoModel, from a directory or a `config` table with random weights
  seeded by `seed`): its last hidden states pooled as `pooling` says (`mean` over the real tokens,
  `cls` the first token's, `last` the last real token's: a decoder embedding model's), then scaled
  to length 1 if `normalize` says so.

`dimensions` (a Matryoshka cut: the vector's first values, renormalised) is honoured only where the
settings declare `matryoshka` or the model's config does as vLLM reads it (`matryoshka_dimensions`,
the cuts it lists and no other, or `is_matryoshka`); otherwise the instance's `unhonoured` names it, and an item asking
for it fails alone, `invalid`, before it reaches the engine (gpu/requests.py). An item with a token
outside the vocabulary, more tokens than the model takes or more dimensions than its vectors have
fails alone, `invalid`, saying which; the rest of its rectangle runs.
"""

from __future__ import annotations

import inspect
import os
import time

import numpy as np
import torch
import transformers

from ..pack.contract import Mode
from ..pack.shapes import DEFAULT_BLOCK_TOKENS
from .base import INVALID, EngineOutcome, ItemResult, truncated, vector_result
from .hf import build_model, dtype_argument, placement

# RoBERTa-like models number positions from past the pad id: they take that many fewer tokens
POSITION_OFFSET_TYPES = ("roberta", "xlm-roberta", "camembert", "longformer")


def is_sentence_transformers(path) -> bool:
    """Whether `path` is a sentence-transformers directory (its module list)."""
    return bool(path) and os.path.isfile(os.path.join(path, "modules.json"))


def model_limits(config) -> tuple[int, int]:
    """(vocabulary size, most tokens an input may hold) of a transformers config."""
    positions = getattr(config, "max_position_embeddings", None) or (1 << 30)
    if getattr(config, "model_type", "") in POSITION_OFFSET_TYPES:
        positions -= (getattr(config, "pad_token_id", None) or 0) + 1
    return int(config.vocab_size), int(positions)


def takes(model, name: str) -> bool:
    """Whether the model's forward names the argument `name`."""
    return name in inspect.signature(model.forward).parameters


class SentenceStack:
    """A sentence-transformers directory's module stack, fed token ids (never text)."""

    def __init__(self, settings, device, dtype):
        from sentence_transformers import SentenceTransformer

        if settings.pooling != "auto":
            raise ValueError(f"{settings.model} is a sentence-transformers directory: its own Pooling module pools "
                             f"(leave `pooling` unset, not {settings.pooling!r})")
        kwargs = {"attn_implementation": settings.attn_implementation, **dtype_argument(dtype)}
        self.st = SentenceTransformer(settings.model, device=str(device), local_files_only=True,
                                      model_kwargs=kwargs).eval()
        model = getattr(self.st[0], "auto_model", None)
        if model is None:
            raise ValueError(f"{settings.model}: its first module ({type(self.st[0]).__name__}) is no transformers "
                             "model: the broker feeds token ids to a Transformer module")
        self.config = model.config
        self.vocab_size, positions = model_limits(model.config)
        self.max_tokens = min(positions, int(self.st.max_seq_length or positions))
        self.limit_name = "max_seq_length" if self.max_tokens < positions else "positions"
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.token_types = takes(model, "token_type_ids")
        # sentence-transformers >= 5.4 names it get_embedding_dimension (the old name warns)
        dims = getattr(self.st, "get_embedding_dimension", None) or self.st.get_sentence_embedding_dimension
        self.dims = int(dims())

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        features = {"input_ids": ids, "attention_mask": mask}
        if self.token_types:
            features["token_type_ids"] = torch.zeros_like(ids)
        return self.st(features)["sentence_embedding"]


class PooledEncoder:
    """A plain transformers encoder (AutoModel) whose last hidden states are pooled."""

    def __init__(self, settings, device, dtype):
        self.model = build_model(settings, dtype, transformers.AutoModel).to(device).eval()
        self.pooling = "mean" if settings.pooling == "auto" else settings.pooling
        cfg = self.config = self.model.config
        self.vocab_size, self.max_tokens = model_limits(cfg)
        self.limit_name = "positions"
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
        self.token_types = takes(self.model, "token_type_ids")
        self.no_cache = {"use_cache": False} if takes(self.model, "use_cache") else {}
        self.dims = int(cfg.hidden_size)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": torch.zeros_like(ids)} if self.token_types else {}
        hidden = self.model(input_ids=ids, attention_mask=mask, **extra, **self.no_cache).last_hidden_state
        return pool(hidden, mask, self.pooling)


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """One vector a row of right-padded hidden states: `mean` over the real tokens, `cls` the first
    token's, `last` the last real token's."""
    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.sum(dim=1) - 1]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


class HFEmbed:
    """The `hf` engine of a consumer that embeds: `run(batch)` gives every item its vector."""

    mode = Mode.PADDED

    def __init__(self, settings, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, contract=None, **_options):
        self.settings = settings
        self.block_tokens = block_tokens
        self.device, self.dtype = placement(settings)
        kind = SentenceStack if is_sentence_transformers(settings.model) else PooledEncoder
        self.encoder = kind(settings, self.device, self.dtype)
        self.dims = self.encoder.dims
        # an item's `dimensions` only where the settings or the model's config (as vLLM reads it:
        # `matryoshka_dimensions`, `is_matryoshka`) declare the model Matryoshka-trained
        listed = getattr(self.encoder.config, "matryoshka_dimensions", None)
        self.cuts = tuple(int(d) for d in listed) if listed else None  # None: any cut
        declared = settings.matryoshka or bool(listed) or bool(getattr(self.encoder.config, "is_matryoshka", False))
        self.unhonoured = () if declared else ("dimensions",)

    @torch.inference_mode()
    def run(self, batch) -> EngineOutcome:
        t0 = time.perf_counter()
        tokens = [np.asarray(t) for t in batch.tokens]
        cuts = [None if (o := batch.options_of(k)) is None else o.dimensions for k in range(len(tokens))]
        refused = {k: why for k, t in enumerate(tokens) if (why := self.refusal(t, cuts[k])) is not None}
        rows = [k for k in range(len(tokens)) if k not in refused]
        vectors = self.vectors([tokens[k] for k in rows]) if rows else None
        results: list = [None] * len(tokens)
        for k, why in refused.items():
            results[k] = ItemResult(int(batch.item_ids[k]), INVALID, error=why)
        for j, k in enumerate(rows):
            results[k] = vector_result(batch.item_ids[k], truncated(vectors[j], cuts[k]))
        lengths = [tokens[k].size for k in rows]
        rect = len(rows) * max(lengths, default=0)
        return EngineOutcome(results, engine_seconds=time.perf_counter() - t0, padded_tokens=rect - sum(lengths),
                             rect_tokens=rect)

    def refusal(self, tokens: np.ndarray, dimensions: int | None) -> str | None:
        """Why the model cannot embed this item, or None."""
        enc = self.encoder
        if tokens.size == 0:
            return "no tokens"
        if tokens.size > enc.max_tokens:
            return f"{tokens.size} tokens are more than the model takes ({enc.max_tokens}, its {enc.limit_name})"
        top = int(tokens.max())
        if top >= enc.vocab_size:
            return f"token id {top} is outside the model's vocabulary ({enc.vocab_size})"
        if dimensions is not None and dimensions > self.dims:
            return f"'dimensions' {dimensions} is more than the model's vectors have ({self.dims})"
        if dimensions is not None and self.cuts is not None and dimensions not in (*self.cuts, self.dims):
            return f"'dimensions' {dimensions} is not a cut the model declares ({', '.join(map(str, self.cuts))})"
        return None

    @torch.inference_mode()
    def vectors(self, tokens: list) -> np.ndarray:
        """float32 [n, dims]: the items as one right-padded rectangle, one forward."""
        width = max(t.size for t in tokens)
        ids = np.full((len(tokens), width), self.encoder.pad_id, np.int64)
        mask = np.zeros((len(tokens), width), np.int64)
        for i, t in enumerate(tokens):
            ids[i, : t.size] = t
            mask[i, : t.size] = 1
        out = self.encoder(torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device))
        if self.settings.normalize:
            out = torch.nn.functional.normalize(out, p=2, dim=1)
        return out.float().cpu().numpy()

    def close(self) -> None:
        self.encoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
