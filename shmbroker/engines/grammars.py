"""Constraints (request/structured.py) compiled by xgrammar against a model directory's tokenizer.

The `hf` engine honours a constraint with them: xgrammar's own logits processor for transformers
(`xgrammar.contrib.hf.LogitsProcessor`) masks the logits of the rows that carry it. The `trtllm`
engine checks each distinct constraint with them before TensorRT-LLM sees it (`PreCheck`), since its
library compiles it with the same xgrammar: one it could not compile fails its item alone, at add,
as vLLM's own check does, not inside the library, where a run of such failures would read as a dead
engine.

- Compiled once per engine: a constraint (its kind, payload digest and switches) is compiled the
  first time an item carries it and kept (the last GRAMMARS_KEPT used), a failure too, so a job's
  items sharing a schema compile it once. A constraint xgrammar cannot compile fails its item alone,
  `invalid`, with xgrammar's message; the batch's other items run.
- What each kind compiles to, as vLLM's xgrammar backend does it: a JSON schema with
  `compile_json_schema` (`disable_any_whitespace`: `any_whitespace=False` and compact separators;
  xgrammar's strict mode refuses properties a schema does not name, so `disable_additional_properties`
  is what it does anyway); `json_object` as the schema {"type": "object"} (an object, as the API means
  it: xgrammar's builtin JSON grammar takes any JSON value); a regex with `compile_regex`; a choice
  as the regex of its escaped choices joined by `|`; a grammar with `compile_grammar` (EBNF, GBNF).
- One processor per constrained option group, not per batch: xgrammar's processor gives every row of
  what it is called on a grammar (one, or one per row), so it cannot leave a row unconstrained. The
  engine decodes its own loop (`hf_sampling.py`), so it calls each group's processor on that group's
  rows alone: rows without a constraint are never masked, and the rectangle is not split. A
  processor is used for one decode (it keeps its rows' matchers), a compiled grammar for many.
- A constrained row ends when its grammar does: on one of the grammar's stop ids (the model's EOS
  ids, or the tokenizer's when the model names none), kept as its last token, whatever `ignore_eos`
  or `min_tokens` say (a finished grammar allows nothing else).
xgrammar is imported, and the tokenizer's vocabulary read, at the first constraint.
"""

from __future__ import annotations

import importlib.util
import re
from collections import OrderedDict

from ..request.structured import Constraint, Structured, Switch

GRAMMARS_KEPT = 256  # compiled constraints (and failures) an engine keeps, least recently used out
REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " before its message


def available() -> bool:
    """Is xgrammar installed (the hf extra has it)?"""
    return importlib.util.find_spec("xgrammar") is not None


class GrammarError(ValueError):
    """A constraint xgrammar cannot compile; the message is xgrammar's."""


class Grammars:
    """The engine's compiled constraints: `error(s)` says why one cannot be compiled (None: it can),
    `processor(s)` is a fresh logits processor of one, with the ids that end its rows."""

    def __init__(self, tokenizer, vocab_size: int, eos):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = sorted(eos)
        self.ends: frozenset = frozenset()  # the grammars' stop ids, once the compiler is built
        self._compiler = None
        self._kept: OrderedDict = OrderedDict()  # Structured -> its CompiledGrammar, or a GrammarError

    def compiler(self):
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.eos or None)
            self.ends = frozenset(int(t) for t in info.stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # kept here, bounded
        return self._compiler

    def compiled(self, s: Structured):
        """The constraint's CompiledGrammar; GrammarError (xgrammar's message) when it cannot be."""
        got = self._kept.get(s)
        if got is None:
            compiler = self.compiler()
            try:
                got = compile_constraint(compiler, s)
            except Exception as exc:  # noqa: BLE001 - anything xgrammar raises is the constraint's
                got = GrammarError(message_of(exc))
            if len(self._kept) >= GRAMMARS_KEPT:
                self._kept.popitem(last=False)
            self._kept[s] = got
        else:
            self._kept.move_to_end(s)
        if isinstance(got, GrammarError):
            raise got
        return got

    def error(self, s: Structured) -> str | None:
        try:
            self.compiled(s)
        except GrammarError as exc:
            return str(exc)
        return None

    def processor(self, s: Structured):
        """(a new xgrammar logits processor of the constraint, the ids that end its rows)."""
        from xgrammar.contrib.hf import LogitsProcessor

        return LogitsProcessor(self.compiled(s)), self.ends


def compile_constraint(compiler, s: Structured):
    """The constraint compiled by xgrammar's compiler (module docstring: which call for which kind)."""
    compact = s.has(Switch.DISABLE_ANY_WHITESPACE)
    json_format = {"any_whitespace": not compact, "separators": (",", ":") if compact else None}
    if s.kind == Constraint.JSON:
        return compiler.compile_json_schema(s.value(), **json_format)
    if s.kind == Constraint.JSON_OBJECT:
        return compiler.compile_json_schema('{"type": "object"}', **json_format)
    if s.kind == Constraint.REGEX:
        return compiler.compile_regex(s.value())
    if s.kind == Constraint.CHOICE:
        return compiler.compile_regex(choice_regex(s.value()))
    return compiler.compile_grammar(s.value())


def choice_regex(choices) -> str:
    """A regex that matches exactly one of the choices."""
    return "|".join("".join("\\" + c if c in REGEX_SPECIAL else c for c in choice) for choice in choices)


def message_of(exc: Exception) -> str:
    """xgrammar's message without its log prefix (its errors read "[time] file.cc:line: message")."""
    text = str(exc).strip() or type(exc).__name__
    return _LOG_PREFIX.sub("", text)


class PreCheck:
    """A constraint checked before a library that compiles it with xgrammar sees it (module
    docstring): `error(opts)` is why an item's constraint cannot compile, or None. The model
    directory's tokenizer is loaded at the first constraint; one transformers cannot load leaves the
    judging to the library (every `error` is then None)."""

    def __init__(self, model_dir: str, eos):
        self.model_dir = model_dir
        self.eos = eos
        self._grammars: Grammars | None | bool = None  # False: no tokenizer loaded, nothing checked

    def error(self, opts) -> str | None:
        s = None if opts is None else opts.structured
        if s is None or self._grammars is False:
            return None
        if self._grammars is None:
            try:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            except Exception:  # noqa: BLE001 - no tokenizer to check against: the library judges alone
                self._grammars = False
                return None
            self._grammars = Grammars(tokenizer, len(tokenizer), self.eos)
        return self._grammars.error(s)
