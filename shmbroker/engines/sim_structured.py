"""How the simulated engine (a simulator, named as one) honours a constraint (request/structured.py).

With a tokenizer (`SimSettings.tokenizer`), a constrained item's output is text that meets its
constraint, in that tokenizer's ids, so the whole path (a job's lines, their outputs' parsing and
validation) is testable without a model:
- `choice`: one of the choices, picked by the sample's key;
- `json_object`: an object of one member, `{"sim": <a number from the key>}`;
- `json` (a schema): the smallest instance of the schema (`instance`): an object's required
  properties (all of them when none is required), an enum's or a const's value, the first branch of
  an `anyOf` / `oneOf`, `$ref`s into `$defs`, arrays of `minItems` items, numbers at their minimum;
- `regex` and `grammar` are accepted and not modeled: the output is the simulator's usual ids.
A text longer than max_new_tokens is cut there (finish reason `length`); otherwise the sample ends
with its text (`stop`). Without a tokenizer a constrained item gets the usual ids.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from ..request.extras import encode_extras
from ..request.structured import Constraint, Structured
from .sim_requests import modeled_logprobs, sample_keys

MAX_DEPTH = 16  # a recursive schema's instance stops nesting here


class StructuredText:
    """Valid text of a constraint, in a tokenizer's ids (`tokenizers.Tokenizer` from its file)."""

    def __init__(self, path: str):
        import os

        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self.tokenizer = Tokenizer.from_file(file)

    def models(self, s: Structured) -> bool:
        return s.kind in (Constraint.CHOICE, Constraint.JSON_OBJECT, Constraint.JSON)

    def text(self, s: Structured, key: int) -> str:
        if s.kind == Constraint.CHOICE:
            choices = s.value()
            return choices[key % len(choices)]
        if s.kind == Constraint.JSON_OBJECT:
            return json.dumps({"sim": key % 1000}, separators=(",", ":"))
        schema = json.loads(s.value())
        return json.dumps(instance(schema, schema, 0), separators=(",", ":"))

    def result(self, s: Structured, key: int, max_new: int, opts) -> tuple[np.ndarray, np.ndarray]:
        """(every sample's tokens, one after another; the extras words) of a constrained item."""
        rows, lengths, stopped = [], [], []
        for k in sample_keys(key, opts.samples).tolist():
            ids = np.array(self.tokenizer.encode(self.text(s, int(k)), add_special_tokens=False).ids, np.uint32)
            rows.append(ids[:max_new])
            lengths.append(int(min(ids.size, max_new)))
            stopped.append(bool(ids.size <= max_new))
        tokens = np.concatenate(rows) if rows else np.zeros(0, np.uint32)
        logprobs = [modeled_logprobs(r, opts.top_logprobs or 0) for r in rows] if opts.logprobs else None
        return tokens.astype(np.uint32), encode_extras(lengths, stopped, None, logprobs)


def instance(schema, root: dict, depth: int):
    """The smallest value the JSON schema `schema` accepts (the module docstring's rules)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        defs = root.get("$defs") or root.get("definitions") or {}
        return instance(defs.get(name, {}), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for branch in ("anyOf", "oneOf", "allOf"):
        if schema.get(branch):
            return instance(schema[branch][0], root, depth + 1)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        names = schema.get("required") or list(props)
        return {n: instance(props.get(n, {"type": "string"}), root, depth + 1) for n in names}
    if kind == "array":
        items = schema.get("items") or {"type": "string"}
        return [instance(items, root, depth + 1) for _ in range(int(schema.get("minItems", 0)))]
    if kind == "string":
        return "s" * max(1, int(schema.get("minLength", 1)))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        value = low + 1 if "exclusiveMinimum" in schema else low
        return int(value) if kind == "integer" else value
    if kind == "boolean":
        return False
    return None


def unmodeled(opts, text: StructuredText | None) -> bool:
    """Options that change nothing in the simulator: a constraint alone that it does not model (no
    tokenizer, `text` None, or a regex or grammar): the item gets the usual ids, as without options."""
    s = opts.structured
    return s is not None and not (text is not None and text.models(s)) and not replace(opts, structured=None)
