"""A word-level tokenizer with a ChatML chat template, written by a test: what a model's tokenizer
directory holds (`tokenizer.json`, `tokenizer_config.json` with its `chat_template`)."""

from __future__ import annotations

import json

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = [f"w{i}" for i in range(200)]


def tokenizer_dir(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS + ["user", "assistant", "system"])],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"]))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|im_end|>",
        "chat_template": CHATML}))
    return path
