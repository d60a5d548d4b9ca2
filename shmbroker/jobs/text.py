"""Text prompts: a local tokenizer, read with the `tokenizers` package, on the producer's side only.

`submit --tokenizer PATH` (a `tokenizer.json`, or a directory holding one, as a model's Hugging
Face directory does) encodes text prompts into token ids before they are submitted, and decodes
generated ids back into text in the results. The broker never sees text nor knows the model.
"""

from __future__ import annotations

import os

import numpy as np


class TextError(Exception):
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

    def chat_template(self):
        """The model's chat template, read from the tokenizer's directory (`request/chat.py`)."""
        if self._chat is None:
            from ..request.chat import ChatTemplate

            self._chat = ChatTemplate.from_dir(self.directory)
        return self._chat

    def encode(self, text: str) -> np.ndarray:
        return np.array(self._tok.encode(text, add_special_tokens=False).ids, np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
