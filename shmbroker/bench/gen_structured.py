"""`bench gen --structured`: every item constrained by one of four JSON schemas, on both sides.

The model needs a tokenizer for a constraint to compile: a byte-level BPE is trained here on JSON and
the schemas' keys (`write_tokenizer`), the random model's vocabulary is the tokenizer's, and its end
of sequence is the tokenizer's `<|im_end|>`, so an item ends when its JSON is whole (the grammar then
allows nothing else). The schemas are bounded (enums, small integers, short strings, at most a few
array items) so a random model's greedy output ends within `MAX_NEW_TOKENS`. Both sides get the same
requests: `response_format` json_schema, greedy; the engine settings choose xgrammar without free
whitespace (`ENGINE_SETTINGS`), on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>"]
EOS = "<|im_end|>"
MAX_NEW_TOKENS = 48  # the default --max-new-tokens with --structured: a schema's JSON fits
ENGINE_SETTINGS = {"structured_outputs_backend": "xgrammar", "disable_any_whitespace": True}
WORD = {"type": "string", "pattern": "^[a-z]{1,6}$"}
SCHEMAS = [
    {"type": "object", "properties": {"label": {"enum": ["spam", "ham", "unsure"]},
                                      "score": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["label", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": WORD},
     "required": ["ok", "reason"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 2}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
]


def structured_options(n: int) -> list[dict]:
    """Each of n items' request options: item i under schema i % 4."""
    formats = [{"type": "json_schema", "json_schema": {"name": f"schema{k}", "schema": s, "strict": True}}
               for k, s in enumerate(SCHEMAS)]
    return [{"response_format": formats[i % len(formats)]} for i in range(n)]


def write_tokenizer(path: Path, vocab_size: int) -> tuple[int, int]:
    """A byte-level BPE in `path` (tokenizer.json, tokenizer_config.json); (its vocabulary size, its
    end-of-sequence id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(s) for s in SCHEMAS] + ['{"label":"spam","score":3}', '{"ok":true,"reason":"abc"}',
                                                 '{"tags":["ab","cd"]}', '{"point":{"x":1,"y":2}}']
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<|im_start|>",
        "eos_token": EOS, "model_max_length": 1 << 16}))
    return tok.get_vocab_size(), tok.token_to_id(EOS)
