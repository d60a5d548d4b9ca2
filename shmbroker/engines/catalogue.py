"""The engine registry: each engine declared once (name, module, class, extra, settings, mode, and
the request options it honours).

Adding an engine is one `EngineEntry` here. Nothing in this module imports an engine's packages:
`load_engine(name, settings)` imports the module only when a GPU process loads the engine, so the
broker imports no torch, vllm or tensorrt_llm unless a consumer uses them.

The mode (docs/design.md "Words") is declared by the entry: `padded` for a rectangle engine, `packed`
for a paged-KV one, `SETTINGS` where the engine's settings choose it (the simulated engine models
either). An engine class may state a `mode` too; `load_engine` refuses one that disagrees with
its entry. A `padded` engine computes whole batches (`run`); the registry puts it behind the
streaming interface with `BatchStream`, so every loaded engine has `add`/`poll`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum

from ..pack.contract import Mode, as_mode
from ..request.options import EMBED_OPTIONS, GENERATE_OPTIONS, Task
from .base import EngineUnavailable
from .batch_stream import BatchStream
from .options import task_of


class FromSettings(Enum):
    """An entry's mode that is no Mode: the engine settings' `mode` field chooses it."""

    SETTINGS = "settings"


SETTINGS = FromSettings.SETTINGS


@dataclass(frozen=True)
class EngineEntry:
    name: str
    module: str
    cls: str
    extra: str | None  # the package extra that installs what it imports (None: the core has it)
    settings: str  # "module:Class" of its settings dataclass (parsed without importing the engine)
    mode: Mode | FromSettings  # a Mode, or SETTINGS
    streaming: bool  # True: the class implements add/poll; False: run(batch), behind BatchStream
    # the request options (request/options.py OPTION_NAMES) it honours; an item asking for another
    # fails alone, `invalid`, naming it (gpu/requests.py). An instance may honour fewer than its
    # entry says (its `unhonoured`, from its settings: vLLM, TensorRT-LLM and hf without a tokenizer
    # have no stop strings; a TensorRT-LLM release without a SamplingParams field has no such option).
    honours: frozenset = frozenset()
    # what it honours when its consumer embeds (`task = "embed"`); empty: it does not embed, and its
    # settings refuse the task (config/engines.py). `dimensions` only where the model declares it.
    embeds: frozenset = frozenset()

    def __post_init__(self):
        if self.mode is not SETTINGS:
            object.__setattr__(self, "mode", as_mode(self.mode, f"engine {self.name!r}: mode"))

    def settings_class(self):
        module, cls = self.settings.split(":")
        return getattr(importlib.import_module(module), cls)

    def mode_of(self, settings) -> Mode:
        return Mode(settings.mode) if self.mode is SETTINGS else self.mode


# what an item's result can carry: its samples, their finish reasons, cached tokens
SAMPLES = frozenset(GENERATE_OPTIONS) - {"logprobs", "top_logprobs"}
WITH_LOGPROBS = frozenset(GENERATE_OPTIONS)  # and each token's logprob with its top ones (sim, vLLM, openai)
# transformers has no presence or frequency penalty (the hf engine samples with its logits processors);
# constraints with xgrammar's logits processor, where the model directory holds a tokenizer
HF_SAMPLES = SAMPLES - {"presence_penalty", "frequency_penalty"}
EMBEDS = frozenset(EMBED_OPTIONS)  # a vector, cut to `dimensions` where the model declares Matryoshka

_OPT = "shmbroker.engines.options"
ENGINES = {e.name: e for e in (
    EngineEntry("sim", "shmbroker.engines.sim", "Sim", None, f"{_OPT}:SimSettings", SETTINGS, True, WITH_LOGPROBS, EMBEDS),
    EngineEntry("hf", "shmbroker.engines.hf", "HF", "hf", f"{_OPT}:HFSettings", Mode.PADDED, False, HF_SAMPLES, EMBEDS),
    EngineEntry("vllm", "shmbroker.engines.vllm", "VLLM", "vllm", f"{_OPT}:VLLMSettings", Mode.PACKED, True,
                WITH_LOGPROBS, EMBEDS),
    EngineEntry("trtllm", "shmbroker.engines.trtllm", "TRTLLM", "trtllm", f"{_OPT}:TRTLLMSettings", Mode.PACKED, True,
                SAMPLES),
    EngineEntry("openai", "shmbroker.engines.openai", "OpenAICompatible", "openai", f"{_OPT}:OpenAISettings",
                Mode.PACKED, True, WITH_LOGPROBS, EMBEDS),
)}


def entry(name: str) -> EngineEntry:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None


def engine_mode(name: str, settings) -> Mode:
    """The mode of engine `name` with these settings, without importing it."""
    return entry(name).mode_of(settings)


def engine_class(e: EngineEntry):
    try:
        impl = getattr(importlib.import_module(e.module), e.cls)
    except ImportError as exc:
        hint = f": pip install 'shmbroker[{e.extra}]'" if e.extra else ""
        raise EngineUnavailable(f"engine {e.name!r} needs packages that are not installed ({exc}){hint}") from exc
    return impl


def check_entry(e: EngineEntry, impl, settings) -> Mode:
    """The entry's mode, after checking the class agrees (a class that states another mode, or an
    entry that says it streams for a class without add/poll, is refused)."""
    mode = e.mode_of(settings)
    stated = getattr(impl, "mode", None)
    if isinstance(stated, str) and stated != mode and e.mode is not SETTINGS:
        raise TypeError(f"engine {e.name!r}: its class {e.cls} says mode {str(stated)!r} but its registry entry says {str(mode)!r}")
    if e.streaming and not (callable(getattr(impl, "add", None)) and callable(getattr(impl, "poll", None))):
        raise TypeError(f"engine {e.name!r}: its entry streams but {e.cls} has no add/poll")
    if not e.streaming and not callable(getattr(impl, "run", None)):
        raise TypeError(f"engine {e.name!r}: its entry runs batches but {e.cls} has no run")
    return mode


def load_engine(name: str, settings, **options):
    """An engine instance by name with the streaming interface (settings: its engine_settings;
    options: broker-wide ones such as block_tokens, and the consumer's contract); imported only now."""
    e = entry(name)
    impl = engine_class(e)
    mode = check_entry(e, impl, settings)
    engine = impl(settings, **options)
    engine.mode = mode
    engine.engine_name = e.name
    engine.task = task_of(settings)
    engine.honours = (e.embeds if engine.task is Task.EMBED else e.honours) - frozenset(getattr(engine, "unhonoured", ()))
    return engine if e.streaming else BatchStream(engine)
