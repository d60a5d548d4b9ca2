"""Text prompts: a local tokenizer, read with the `tokenizers` package, on the producer's side only.

`submit --tokenizer PATH` (a `tokenizer.json`, or a directory holding one, as a model's Hugging
Face directory does) encodes text prompts into token ids before they are submitted, and decodes
generated ids back into text in the results. The broker never sees text nor knows the model.

Without `--tokenizer`, each line's model finds its tokenizer in the broker's `[tokenizers]` table
(published in `broker.json`): `Tokenizers`, which opens each model's once. A `Tokenizer` and a
`Tokenizers` answer the same question, `of(model)`: the tokenizer for that model's lines, or None.
"""

from __future__ import annotations

import os

import numpy as np

from ..ring.items import DEFAULT_MODEL


# prompt ids kept to decode the generated ones in context (vLLM's incremental detokenizer starts
# from as many: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
DECODE_CONTEXT_TOKENS = 5
HEADS_KEPT = 4096  # decoded contexts a Tokenizer keeps
# what a text prompt needs, in an error
NO_TOKENIZER = ("--tokenizer (a tokenizer.json or the model's tokenizer directory), or the model's entry in the "
                "broker's [tokenizers] table")


class TextError(ValueError):
    """No tokenizer can be read from the path given (or the package is missing)."""


class Tokenizer:
    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TextError("text prompts need the tokenizers package: pip install 'shmbroker[text]'") from None
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TextError(f"{path}: no tokenizer.json there")
        try:
            self._tok = HFTokenizer.from_file(file)
        except Exception as exc:  # the package raises its own Exception for a file it cannot read
            raise TextError(f"{file}: not a tokenizer the tokenizers package reads ({exc})") from None
        self.path = file
        self.directory = os.path.dirname(file)
        self._chat = None
        self._heads: dict[tuple, str] = {}  # decoded contexts (`decode`)

    def of(self, model: str | None) -> Tokenizer:
        """The tokenizer of `model`'s lines: this one (given on the command line, it serves every model)."""
        return self

    def chat_template(self):
        """The model's chat template, read from the tokenizer's directory (`request/chat.py`)."""
        if self._chat is None:
            from ..request.chat import ChatTemplate

            self._chat = ChatTemplate.from_dir(self.directory)
        return self._chat

    def encode(self, text: str, special_tokens: bool = False) -> np.ndarray:
        """A text's ids; `special_tokens`: with the ones the tokenizer adds (an encoder's [CLS] and [SEP],
        as an embedding model reads its inputs), else without (a chat template writes its own)."""
        return np.array(self._tok.encode(text, add_special_tokens=special_tokens).ids, np.uint32)

    def token_text(self, token_id: int) -> str:
        """One token's text (for logprobs), as decoding it alone gives it."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def encode_many(self, texts: list[str], special_tokens: bool = False) -> list[np.ndarray]:
        """`encode` of each text, as the tokenizer's own batch (on every core). The batch's fast form
        (tokenizers 0.21 and later) computes no character offsets, which nothing here reads: about
        0.7 of the CPU."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.array(e.ids, np.uint32) for e in encode(texts, add_special_tokens=special_tokens)]

    def decode(self, ids, context=()) -> str:
        """Generated ids as text. `context`: the prompt's last ids (DECODE_CONTEXT_TOKENS), decoded
        before them and cut off again, so the text is what follows the prompt as the engine's own
        detokenizer writes it (a leading space a tokenizer adds only within a text, say). Trailing
        replacement characters are dropped: the bytes of a character cut off by max_tokens, which an
        incremental detokenizer (tokenizers' DecodeStream, vLLM's) never emits."""
        return self._decode(ids, context).rstrip("\ufffd")

    def _decode(self, ids, context) -> str:
        ids = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        if not context or not ids:
            return self._tok.decode(ids, skip_special_tokens=True)
        ctx = tuple(int(i) for i in context)
        head = self._heads.get(ctx)
        if head is None:  # a job's prompts mostly end alike (a chat template's generation prompt)
            if len(self._heads) >= HEADS_KEPT:
                self._heads.clear()
            head = self._heads[ctx] = self._tok.decode(list(ctx), skip_special_tokens=True)
        whole = self._tok.decode([*ctx, *ids], skip_special_tokens=True)
        return whole[len(head):] if whole.startswith(head) else self._tok.decode(ids, skip_special_tokens=True)


class Tokenizers:
    """Each model's tokenizer from a table of model name -> tokenizer path (`default`: the default
    model), each opened on first use; a model the table does not name has none."""

    def __init__(self, paths: dict):
        self.paths = dict(paths)
        self._open: dict[str, Tokenizer] = {}

    def of(self, model: str | None) -> Tokenizer | None:
        name = model or DEFAULT_MODEL
        if name not in self._open:
            path = self.paths.get(name)
            if path is None:
                return None
            self._open[name] = Tokenizer(path)
        return self._open[name]
