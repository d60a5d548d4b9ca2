"""One item's `tensorrt_llm.SamplingParams` from its request options (request/options.py), as plain
data: no tensorrt_llm import here, so it is tested on any machine (`trtllm.py` passes it on).

TensorRT-LLM's LLM API names its sampling fields as vLLM does (tensorrt_llm/sampling_params.py; its
server, trtllm-serve, maps an OpenAI request's fields onto them one to one): temperature, top_p,
top_k, min_p, seed, stop, stop_token_ids, n, presence_penalty, frequency_penalty,
repetition_penalty, min_tokens, ignore_eos, end_id, max_tokens. How they are set:
- greedy (the broker's default, and temperature 0) is `top_k=1`: the LLM API's greedy test, in every
  release (older ones ask top_k 1 or unset and top_p 0 or unset, newer ones also take temperature
  0); top_p, top_k and min_p then change nothing and are not passed. A greedy item asking for n
  samples runs once and its output is its n samples: the LLM API refuses n > 1 with greedy
  decoding, and greedy samples are one sequence anyway (vLLM returns n equal ones);
- a temperature above 0 samples: `temperature`, `top_p` (1.0 unless given: trtllm-serve's default),
  `top_k` (None, the whole vocabulary, unless given above 0), `min_p` when given, `n`;
- seed, the penalties and min_tokens go as given; `seed` is `random_seed` in releases whose
  SamplingParams has no `seed`;
- the end of sequence: `end_id` is the model's first EOS id and its others are `stop_token_ids` (the
  LLM API takes one end_id), with the item's own stop ids after them; `ignore_eos` ignores every EOS
  id of the model, the others left out of the stop ids, but not an asked stop id (as vLLM's does);
- `stop` strings go as given: the LLM API encodes each with the model's tokenizer and matches those
  ids, so a model directory without a tokenizer cannot take them (`trtllm_unhonoured`);
- an item with stop strings or ids asks `include_stop_str_in_output=True`: its tokens keep what
  stopped it, as vLLM's token ids do (the LLM API would cut it from the ids otherwise);
- a constraint (request/structured.py) is `guided_decoding=GuidedDecodingParams(...)`
  (`tensorrt_llm.llmapi`, one field set): `json` (the schema's text), `json_object=True`, `regex`,
  `grammar`. TensorRT-LLM has no choice: a choice is the regex of its strings, each escaped
  (`re.escape`), joined by `|`, in a group (`choice_regex`). The switches `disable_any_whitespace`
  and `disable_additional_properties` have no TensorRT-LLM field: they are accepted and change
  nothing (the backend's own whitespace and additional-properties rules apply; the output is still
  JSON valid for the schema). The backend compiles a constraint against the tokenizer's vocabulary,
  so an instance without a tokenizer, or built without a `guided_decoding_backend`, does not honour
  constraints (`trtllm_unhonoured`).
An installed SamplingParams that lacks a field (an older release without min_p, say) makes its
option unhonoured by that instance (`sampling_fields`, `trtllm_unhonoured`): an item asking for it
fails `invalid`, never runs without it.
"""

from __future__ import annotations

import inspect
import re

from ..request.structured import Constraint

# request options (request/options.py) that `tensorrt_llm.SamplingParams` takes as fields of the same
# name and meaning, whether the item samples or not; `seed` is `random_seed` in older releases
TRTLLM_SAME_NAME = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
TRTLLM_OPTIONS = (*TRTLLM_SAME_NAME, "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                  "n", "ignore_eos", "structured")
# `GuidedDecodingParams`' field of each constraint kind but a choice (a regex: `choice_regex`)
GUIDED_FIELD = {Constraint.JSON: "json", Constraint.JSON_OBJECT: "json_object", Constraint.REGEX: "regex",
                Constraint.GRAMMAR: "grammar"}


def sampling_fields(params_class) -> frozenset | None:
    """The keyword arguments a `SamplingParams` class takes (None: any, or it cannot say)."""
    try:
        params = inspect.signature(params_class).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def trtllm_field(option: str, fields) -> str:
    """The `SamplingParams` field that carries a request option in this release."""
    if option == "seed" and fields is not None and "seed" not in fields and "random_seed" in fields:
        return "random_seed"
    return "guided_decoding" if option == "structured" else option


def trtllm_unhonoured(fields, tokenizer: bool, guided: bool = True) -> set:
    """The options a TensorRT-LLM instance cannot honour: those its `SamplingParams` has no field for;
    stop strings and constraints without a tokenizer (the LLM API turns stop strings into token ids
    with it, the backend compiles constraints against its vocabulary); constraints when the LLM was
    built without a `guided_decoding_backend` (`guided` false)."""
    out = set() if tokenizer else {"stop", "structured"}
    if not guided:
        out.add("structured")
    if fields is not None:
        out |= {o for o in TRTLLM_OPTIONS if trtllm_field(o, fields) not in fields}
    return out


def constraint_precheck(model: str, eos_ids, unhonoured, llm_kwargs: dict):
    """A `grammars.PreCheck` of the model directory's tokenizer when constraints are honoured and the
    LLM's backend is xgrammar (the library checked against is the one that compiles them) and
    xgrammar is installed here; else None (the library's own error then fails the request)."""
    from .grammars import PreCheck, available

    if "structured" in unhonoured or llm_kwargs.get("guided_decoding_backend") != "xgrammar" or not available():
        return None
    return PreCheck(model, eos_ids)


def trtllm_sampling(max_new_tokens: int, eos_ids, options=None, fields=None, guided=dict) -> dict:
    """`tensorrt_llm.SamplingParams(...)` of one item: greedy (top_k=1), token ids only, unless its
    request options say otherwise (`fields`: what the installed SamplingParams takes, None: all; `guided`
    builds a constraint's `guided_decoding`: the engine passes `GuidedDecodingParams`). Without
    a tokenizer the LLM API needs `end_id` given; with no end-of-sequence id known an item generates all
    its max_new_tokens (end_id -1 and ignore_eos, as the executor itself does for ignore_eos). A greedy
    item asking for n samples runs once (the LLM API refuses n > 1 greedy: its samples are one)."""
    out = {"max_tokens": int(max_new_tokens), "top_k": 1, "detokenize": False}
    eos = [int(t) for t in eos_ids]
    ignore_eos = options is not None and bool(options.ignore_eos)
    stops = [] if ignore_eos else eos[1:]  # the model's other EOS ids are EOS too
    if eos:
        out.update(end_id=eos[0], pad_id=eos[0])
    else:
        out.update(end_id=-1, pad_id=0)
        ignore_eos = True
    if ignore_eos:
        out["ignore_eos"] = True
    if options is not None:
        out.update(_trtllm_options(options, fields))
        if options.structured is not None:
            out["guided_decoding"] = trtllm_guided(options.structured, guided)
        stops += [int(t) for t in options.stop_token_ids or () if int(t) not in stops]
    if stops:
        out["stop_token_ids"] = stops
    return out


def _trtllm_options(options, fields) -> dict:
    given = options.given()
    out = {k: given[k] for k in TRTLLM_SAME_NAME if k in given}
    if options.seed is not None:
        out[trtllm_field("seed", fields)] = options.seed
    if options.stop:
        out["stop"] = list(options.stop)
    if options.stop or options.stop_token_ids:
        # the output keeps what stopped it, as vLLM's token ids do (the LLM API cuts it otherwise)
        if fields is None or "include_stop_str_in_output" in fields:
            out["include_stop_str_in_output"] = True
    if not options.greedy:  # top_k None: the whole vocabulary; top_p 1.0 as trtllm-serve's default
        out.update(temperature=options.temperature, top_k=options.top_k if (options.top_k or 0) > 0 else None,
                   top_p=1.0 if options.top_p is None else options.top_p, n=options.samples)
        if options.min_p is not None:
            out["min_p"] = options.min_p
    return out


def trtllm_guided(s, guided=dict):
    """`GuidedDecodingParams(...)` of a constraint, its payload read, built by `guided` (a dict by
    default: plain data). The switches have no field (module docstring)."""
    if s.kind == Constraint.CHOICE:
        return guided(regex=choice_regex(s.value()))
    return guided(**{GUIDED_FIELD[s.kind]: s.value()})


def choice_regex(choices) -> str:
    """A regex that matches exactly one of the strings: each escaped, joined by `|`, in a group."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"
