"""A random BERT-like sentence-transformers directory and a corpus for it, written locally (no download).

The tokenizer is word-level over fixed-width words (`w00005`, `w00006`, ...): the text of token ids
`[a, b, c]` is `"w0000a w0000b w0000c"`, which the tokenizer maps back to `[CLS] a b c [SEP]` (`texts`). So a
corpus drawn as token ids is also text that sentence-transformers' own `encode` tokenizes to exactly
those ids, and a text's length in characters is proportional to its tokens (the length
sentence-transformers sorts by). `bench embed` and the hf engine's tests use it.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, CLS, SEP = 0, 2, 3
FIRST_WORD = len(SPECIAL)  # the first id of a word


def word(token_id: int) -> str:
    """The word of a token id (fixed width)."""
    return f"w{token_id:05d}"


def texts(flat, offsets) -> list[str]:
    """The text of each input of a corpus (`corpus`): its words without [CLS] and [SEP], which the
    tokenizer adds back."""
    words = np.array([word(i) for i in range(int(flat.max()) + 1)], dtype=object)
    return [" ".join(words[flat[offsets[i] + 1 : offsets[i + 1] - 1]]) for i in range(len(offsets) - 1)]


def tokenizer(vocab_size: int, max_tokens: int):
    """A word-level fast tokenizer of `vocab_size` ids ([CLS] text [SEP], single-text inputs)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    if not FIRST_WORD < vocab_size <= 100_000:
        raise ValueError(f"vocab_size must be in ({FIRST_WORD}, 100000], got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL)} | {word(i): i for i in range(FIRST_WORD, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                model_max_length=max_tokens)


def bert_config(layers: int, hidden: int, vocab_size: int, max_tokens: int) -> dict:
    """A BERT-like encoder's config as a table (`hf` engine settings' `config`, or `write_model`'s)."""
    return {"model_type": "bert", "vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": max(1, hidden // 64), "intermediate_size": 4 * hidden,
            "max_position_embeddings": max_tokens, "pad_token_id": PAD}


def write_model(path: str, *, layers: int = 4, hidden: int = 256, vocab_size: int = 8192, max_tokens: int = 512,
                pooling: str = "mean", normalize: bool = True, seed: int = 0) -> str:
    """Write a sentence-transformers directory at `path` (Transformer, Pooling, and Normalize when
    `normalize`) over a random BERT-like encoder (weights seeded by `seed`); `path`."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():  # sentence-transformers >= 6 moved `models` (the old path still works)
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models

    raw = bert_config(layers, hidden, vocab_size, max_tokens)
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    encoder = os.path.join(path, "encoder")
    transformers.BertModel(config).save_pretrained(encoder)
    tokenizer(vocab_size, max_tokens).save_pretrained(encoder)
    stack = [models.Transformer(encoder, max_seq_length=max_tokens), models.Pooling(hidden, pooling_mode=pooling)]
    stack += [models.Normalize()] if normalize else []
    SentenceTransformer(modules=stack, device="cpu").save(path)
    return path


def corpus(num_texts: int, *, vocab_size: int, seed: int = 0, min_tokens: int = 16,
           max_tokens: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """(flat token ids, offsets) of `num_texts` inputs, [CLS] words [SEP] each, whose lengths are
    long-tailed between `min_tokens` and `max_tokens` (lognormal: median about 60, one in a hundred
    past 400): most texts short, a few long, as real documents and chunks are."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(min_tokens + rng.lognormal(np.log(45.0), 0.95, num_texts)), min_tokens, max_tokens)
    lengths = lengths.astype(np.int64)
    offsets = np.zeros(num_texts + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = rng.integers(FIRST_WORD, vocab_size, int(offsets[-1]), dtype=np.uint32)
    flat[offsets[:-1]] = CLS
    flat[offsets[1:] - 1] = SEP
    return flat, offsets
