"""A byte-level BPE tokenizer with a ChatML template that renders tools, written by a test: a word-level
tokenizer cannot spell JSON, so structured outputs are tested with this one."""

from __future__ import annotations

import json

SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ['{"name": "alpha", "age": 12, "tags": ["x", "y"], "ok": true, "value": null}',
          "user assistant system tools function parameters properties required type object string integer",
          "the quick brown fox jumps over the lazy dog"]


def bpe_tokenizer_dir(path, vocab_size: int = 512):
    """`path` holding tokenizer.json (byte-level BPE, ids below vocab_size) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 50, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "chat_template": TEMPLATE, "model_max_length": 2048}))
    return path
