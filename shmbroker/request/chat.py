"""A chat's messages rendered to a prompt with the model's own chat template, on the producer's side.

The template is the model's: `chat_template` in its tokenizer directory's `tokenizer_config.json`
(a string, or a list of named templates of which "default" is used), else the directory's
`chat_template.jinja`. It is rendered as transformers' `apply_chat_template` renders it: jinja2's
immutable sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, the
`tojson` filter and the `raise_exception` and `strftime_now` globals, `messages`, the tokenizer's
special tokens (`bos_token`, `eos_token`, ...), `add_generation_prompt=True` and the request's
`chat_template_kwargs`. The rendered text is then tokenized without adding special tokens: the
template writes the ones the model expects.

Messages are checked first (`check_messages`), with errors that name the message and the field:
roles `system`, `developer`, `user`, `assistant` (with its `tool_calls`) and `tool` (with its
`tool_call_id`); content a string or a list of text parts
(`{"type": "text", "text": ...}`), which are joined with newlines as vLLM joins them for a
template that takes string content.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields a message may hold besides its role and content: an assistant's earlier tool calls, a tool
# message's answer to one (passed to the template as given)
MESSAGE_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatError(ValueError):
    """A chat that cannot be rendered: a wrong message, no template, or a template that fails."""


def check_messages(messages) -> list[dict]:
    """The messages as the template gets them (content parts joined); ChatError says what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        extra = sorted(set(m) - {"role", "content", "name"} - MESSAGE_FIELDS.get(role, set()))
        if extra:
            raise ChatError(f"messages[{i}] has field(s) {', '.join(extra)} that are not served")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ChatError(f"messages[{i}].tool_calls must be a list")
        if calls and m.get("content") is None:  # an assistant turn that only called tools
            out.append({**m, "content": ""})
            continue
        out.append({**m, "content": content_text(m.get("content"), f"messages[{i}]")})
    return out


def content_text(content, where: str, kinds: tuple = ("text",)) -> str:
    """A message's content as one text: a string, or text parts (of types `kinds`) joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}.content[{k}] must be a text part ({{\"type\": \"{kinds[0]}\", \"text\": ...}}), "
                                f"got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatError(f"{where}.content must be a string or a non-empty list of text parts")


class ChatTemplate:
    """A model's chat template and special tokens, read from its tokenizer directory."""

    def __init__(self, source: str, special: dict[str, str] | None = None, path: str = "<template>"):
        self.source = source
        self.special = dict(special or {})
        self.path = path
        try:
            self._template = _environment().from_string(source)
        except Exception as exc:  # jinja2's TemplateSyntaxError and kin
            raise ChatError(f"{path}: the chat template does not compile ({exc})") from None
        # The template's globals flattened once: each render then hands jinja2 one plain dict as a
        # shared context, which is what `Template.render` builds from its chain of globals per call
        # (half a render's time on a short chat).
        from jinja2.runtime import new_context

        self._globals = dict(self._template.globals)
        self._new_context = new_context

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> ChatTemplate:
        d = os.fspath(directory)
        config = _read_config(os.path.join(d, "tokenizer_config.json"))
        source = _template_of(config)
        path = os.path.join(d, "tokenizer_config.json")
        jinja = os.path.join(d, "chat_template.jinja")
        if source is None and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                source, path = f.read(), jinja
        if source is None:
            raise ChatError(f"{d}: no chat template (neither 'chat_template' in tokenizer_config.json "
                            "nor chat_template.jinja)")
        special = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        return cls(source, special, path)

    def render(self, messages, chat_template_kwargs: dict | None = None, tools: list | None = None) -> str:
        """The prompt text of `messages` (checked), ending in the generation prompt; `tools` (function
        tools) are the template's `tools`, as transformers passes them."""
        kwargs = dict(chat_template_kwargs or {})
        if not all(isinstance(k, str) for k in kwargs):
            raise ChatError("'chat_template_kwargs' must be an object")
        reserved = sorted({"messages", "add_generation_prompt", "tools"} & set(kwargs))
        if reserved:
            raise ChatError(f"'chat_template_kwargs' may not set {', '.join(reserved)}")
        context = {**self._globals, **self.special, **kwargs, "messages": check_messages(messages),
                   "add_generation_prompt": True, "tools": tools}
        t = self._template
        try:
            ctx = self._new_context(t.environment, t.name, t.blocks, context, True, self._globals, None)
            return t.environment.concat(t.root_render_func(ctx))
        except ChatError:
            raise
        except Exception as exc:  # an error the template raises, or a sandbox refusal
            raise ChatError(f"{self.path}: the chat template failed on these messages ({exc})") from None


def _read_config(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ChatError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ChatError(f"{path}: not a JSON object")
    return config


def _template_of(config: dict) -> str | None:
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: the default one
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _raise_exception(message):
    raise ChatError(f"the chat template refused these messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment():
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatError("chat requests need the jinja2 package: pip install 'shmbroker[text]'") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
