"""Each engine's settings (`[consumers.engine_settings]`), declared as frozen dataclasses.

A key's default is its field's default, and its field's `help` metadata says what it means
(docs/configuration.md is generated from them, `config/reference.py`). The configuration reads a
table into these (`config/engines.py`); nothing here reads TOML or imports the configuration.

This module imports nothing heavy: the configuration is checked without torch, vllm, tensorrt_llm
or httpx. The engine modules (`hf.py`, `vllm.py`, `trtllm.py`, `openai.py`) import their packages
only when a GPU process loads them (`catalogue.load_engine`).

An engine's mode is not a setting: its registry entry declares it (`catalogue.py`), except for the
simulated engine, which models either and takes its mode from `SimSettings.mode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pack.contract import Mode
from ..request.options import Task
from .cost import SimCost

def task_field():
    """Every engine's `task` key: what its consumer serves."""
    return field(default=Task.GENERATE, metadata={"help": "what the consumer serves: `generate` (tokens) or `embed` "
                                                          "(one vector a prompt); an item of the other task fails "
                                                          "alone"})


def task_of(settings) -> Task:
    """The task an engine's settings declare (`generate` where they have no `task` key)."""
    return Task(getattr(settings, "task", Task.GENERATE))


def embeds(settings) -> bool:
    """Does this consumer's engine embed (`task = "embed"`)?"""
    return task_of(settings) is Task.EMBED


DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class SimSettings:
    """The simulated engine of one consumer: its mode, its cache, its cost model, and its pace:
    `pace_seconds` wall seconds per modeled second (0: as fast as the CPU runs it, the modeled
    seconds reported, not spent). A paced engine finishes each item when the modeled clock says,
    so consumers of different sizes split a backlog as real cards would (supervise, demo).
    `start_seconds`: wall seconds its constructor takes, as a large model's loading does (tests of
    what waits on a consumer that starts).

    Faults, for tests of what the broker does when an engine misbehaves (each off when None; a
    `*_token` marks an item by a token id its prompt holds):
    `poison_token`: adding such an item kills the process (`poison_kill`: "abort" = SIGABRT,
    "segfault" = SIGSEGV, "exit" = exit status 137 as after the OOM killer); `hang_token`: such an
    item never finishes (the engine runs the others); `block_token`: once such an item was added,
    the next poll never returns (the process hangs); `fail_token`: add refuses such an item (it
    raises ValueError); `fail_after`: a dead engine, once this many items were added every poll
    raises RuntimeError."""

    mode: Mode = field(default=Mode.PACKED, metadata={"help": "`padded` or `packed`: the engine the simulation models"})
    cache_tokens: int = field(default=2 << 20, metadata={"help": "the prefix cache's size in tokens"})
    cost: SimCost = SimCost()  # its fields are keys of the same table (the cost model, cost.py)
    pace_seconds: float = field(default=0.04, metadata={"help": "wall seconds per modeled second (0: unpaced, as "
                                                                "fast as the CPU runs it)"})
    start_seconds: float = field(default=0.0, metadata={"help": "wall seconds the engine takes to start, as a "
                                                                "large model's loading does (0: at once)"})
    tokenizer: str | None = field(default=None, metadata={"help": "a tokenizer.json or tokenizer directory: "
                                                                  "constrained items' outputs are valid text in its "
                                                                  "ids (engines/sim_structured.py)"})
    poison_token: int | None = field(default=None, metadata={"help": "tests: adding an item that holds this token "
                                                                     "kills the process (`poison_kill`)"})
    poison_kill: str = field(default="abort", metadata={"help": "tests: how a poison item kills: `abort` (SIGABRT), "
                                                                "`segfault` (SIGSEGV), `exit` (status 137)"})
    hang_token: int | None = field(default=None, metadata={"help": "tests: an item that holds this token never "
                                                                   "finishes"})
    block_token: int | None = field(default=None, metadata={"help": "tests: once an item that holds this token was "
                                                                    "added, the next poll never returns"})
    fail_token: int | None = field(default=None, metadata={"help": "tests: adding an item that holds this token "
                                                                   "is refused (ValueError)"})
    fail_after: int | None = field(default=None, metadata={"help": "tests: once this many items were added, every "
                                                                   "poll raises (a dead engine)"})
    task: Task = task_field()
    embed_dimensions: int = field(default=1024, metadata={"help": "task `embed`: the vectors' length (each a "
                                                                  "deterministic unit vector of its prompt)"})
    matryoshka: bool = field(default=False, metadata={"help": "task `embed`: the modeled model declares Matryoshka "
                                                             "dimensions (items may ask for `dimensions`)"})


SIM_FAULT_TOKENS = ("poison_token", "hang_token", "block_token", "fail_token")
SIM_KILLS = ("abort", "segfault", "exit")


@dataclass(frozen=True)
class HFSettings:
    """transformers on torch. `model`: a local directory (never downloaded); or `config`: a
    transformers config as a table (e.g. { model_type = "llama", hidden_size = 64, ... }) built with
    random weights seeded by `seed` (benchmarks, tests). With `task = "embed"` the model is an
    encoder (engines/hf_embed.py): a sentence-transformers directory pools and normalises with its
    own modules; a plain encoder with `pooling` and `normalize`; `matryoshka` declares that an
    item may ask for fewer `dimensions`. Those three keys are refused with `task = "generate"`."""

    model: str | None = field(default=None, metadata={"help": "a local model directory (loaded with `local_files_only`: "
                                                               "never downloaded); exactly one of `model` and `config`"})
    config: dict | None = field(default=None, metadata={"help": "or a transformers config as a table, built with "
                                                                "random weights seeded by `seed`"})
    dtype: str = field(default="auto", metadata={"help": "the weights' dtype; `auto`: bfloat16 on CUDA, float32 on "
                                                         "the CPU"})
    device: str = field(default="auto", metadata={"help": "`auto` (cuda when torch sees a GPU, else cpu), or `cpu`, "
                                                          "`cuda`, `cuda:1`"})
    seed: int = field(default=0, metadata={"help": "the seed of a `config` model's random weights"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "transformers' attention implementation"})
    reuse_prefix: bool = field(default=True, metadata={"help": "compute a batch's shared prefix once and reuse its "
                                                               "KV for every item"})
    keep_prefix: bool = field(default=True, metadata={"help": "keep the last prefix's KV for the next batch of the "
                                                              "same family"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    task: Task = task_field()
    pooling: str = field(default="auto", metadata={"help": "task `embed`: a plain encoder's pooling, `mean`, `cls` or "
                                                           "`last` (`auto`: a sentence-transformers directory's own "
                                                           "Pooling module, else `mean`)"})
    normalize: bool = field(default=False, metadata={"help": "task `embed`: scale every vector to length 1 (a "
                                                             "sentence-transformers directory's Normalize module "
                                                             "does so already)"})
    matryoshka: bool = field(default=False, metadata={"help": "task `embed`: the model was trained for Matryoshka "
                                                              "dimensions: an item may ask for `dimensions` (its "
                                                              "vector's first values, renormalised); the model's "
                                                              "config declares it too with `matryoshka_dimensions` "
                                                              "(those cuts only) or `is_matryoshka`; else such an "
                                                              "item fails, naming the option"})

    POOLINGS = ("auto", "mean", "cls", "last")  # not a field: the values of `pooling`

    def __post_init__(self):
        if self.pooling not in self.POOLINGS:
            raise ValueError(f"pooling: must be one of {', '.join(self.POOLINGS)}, got {self.pooling!r}")
        if self.task != Task.EMBED:
            asked = [k for k, v in (("pooling", self.pooling != "auto"), ("normalize", self.normalize),
                                    ("matryoshka", self.matryoshka)) if v]
            if asked:
                raise ValueError(f"{', '.join(asked)}: only with task = \"embed\" (an encoder's vectors)")


@dataclass(frozen=True)
class VLLMSettings:
    """Offline `vllm.LLM`; the contract gives max_num_seqs, max_num_batched_tokens, max_model_len.
    `task = "embed"`: vLLM's pooling runner (`runner = "pooling"`, `convert` vLLM's default: `embed`
    for a decoder), one vector a prompt; `max_new_tokens` and the structured-output keys then play no
    part (max_model_len = max_input_len)."""

    model: str = field(default="", metadata={"help": "the model (a directory or a name vLLM loads)"})
    dtype: str = field(default="auto", metadata={"help": "the weights' dtype; `auto`: the model's"})
    max_new_tokens: int = field(default=256, metadata={"help": "the longest generation an item may ask for "
                                                               "(`max_model_len` = `max_input_len` + this)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM's share of the card's memory, "
                                                                         "in (0, 1]"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "cards one engine spans"})
    enforce_eager: bool = field(default=False, metadata={"help": "no CUDA graphs"})
    seed: int = field(default=0, metadata={"help": "vLLM's seed"})
    structured_outputs_backend: str = field(default="auto", metadata={
        "help": "the structured-output backend: `auto`, `xgrammar`, `guidance` (llguidance), `outlines`, "
                "`lm-format-enforcer`"})
    disable_any_whitespace: bool = field(default=False, metadata={
        "help": "JSON constraints without free whitespace (xgrammar and guidance; vLLM reads it per engine)"})
    extra: dict = field(default_factory=dict, metadata={"help": "more `LLM(...)` keyword arguments, passed as given"})
    task: Task = task_field()


STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class TRTLLMSettings:
    """TensorRT-LLM's `LLM` API; the contract gives max_batch_size, max_num_tokens, max_input_len."""

    model: str = field(default="", metadata={"help": "the model (a checkpoint or engine directory)"})
    dtype: str = field(default="auto", metadata={"help": "the weights' dtype; `auto`: the model's"})
    max_new_tokens: int = field(default=256, metadata={"help": "the longest generation an item may ask for "
                                                               "(`max_seq_len` = `max_input_len` + this)"})
    free_gpu_memory_fraction: float = field(default=0.9, metadata={"help": "the KV cache's share of the free memory, "
                                                                           "in (0, 1]"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "cards one engine spans"})
    guided_decoding_backend: str = field(default="xgrammar", metadata={
        "help": "the backend that compiles constraints (structured outputs): `xgrammar`, `llguidance`, or `none` "
                "(not passed: constraints are not honoured); passed only when a tokenizer is loaded"})
    task: Task = task_field()  # `embed` is refused: TensorRT-LLM's LLM API has no pooling runner
    extra: dict = field(default_factory=dict, metadata={"help": "more `LLM(...)` keyword arguments, passed as given"})


GUIDED_BACKENDS = ("xgrammar", "llguidance", "none")  # TRTLLMSettings.guided_decoding_backend


@dataclass(frozen=True)
class OpenAISettings:
    """Any OpenAI-compatible completions server (vLLM serve, SGLang, TGI, trtllm-serve); with
    `task = "embed"` its embeddings endpoint (`/embeddings`, token-id inputs, base64 float32 vectors)."""

    base_url: str = field(default="http://127.0.0.1:8000/v1", metadata={"help": "the server's API root"})
    model: str = field(default="", metadata={"help": "the model name the server serves"})
    api_key_env: str = field(default="", metadata={"help": "the environment variable holding the API key "
                                                           "(\"\": none)"})
    max_in_flight: int = field(default=64, metadata={"help": "requests in flight at once: about the server's batch "
                                                             "size (its `max_num_seqs`)"})
    max_items_per_request: int = field(default=0, metadata={"help": "0: automatic, the fewest of 1 to 4 with which "
                                                                    "`max_in_flight` requests hold `max_batch_size` "
                                                                    "items (openai.default_items_per_request)"})
    timeout_seconds: float = field(default=120.0, metadata={"help": "one request's timeout"})
    retries: int = field(default=3, metadata={"help": "tries after the first of a request the server could not answer"})
    backoff_seconds: float = field(default=0.5, metadata={"help": "the wait before a retry, doubled after each "
                                                                  "failed try"})
    task: Task = task_field()


REQUIRED = {"vllm": ("model",), "trtllm": ("model",), "openai": ("model",)}  # keys each must be given
