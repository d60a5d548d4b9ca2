"""The broker's configuration, declared: each key of `shmbroker.toml` is a dataclass field here.

A key's default is its field's default, written once; code that needs it without a configuration
reads the field (`BrokerConfig.segment_bytes`: spill's segment size for a bare `Backlog.open`).
Each key's field carries its metadata (`key(...)`):

- `help`: what the key means, one line (docs/configuration.md is generated from it, `reference.py`);
- `check`: how its value is checked (`validator.py`), read by `settings.parse` and the table readers;
- `required`: the key must be given; `fill`: the value a reader fills in for a key left out, where the
  field has no default; `default_text`: the default in words, where it is not a value (`data_dir`);
  `key`: the key's name where it differs from the field's; `table`: the header of a field that holds
  a table (`[[consumers]]`), `flat`: that table's keys are names, not fields (`[tokenizers]`); `type`:
  the key's type where the field's is another (GiB, not bytes).

Fields without `help` are not keys (`source`, `ConsumerConfig`'s). This module imports only the
checks, the packer's declarations, the protocol's data directory and model ids: any process below the
configuration (spill's segment files, the results log) may read a default here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import MISSING, dataclass, field

from ..pack.contract import Contract
from ..pack.contract import DEFAULT_STEP_TOKENS
from ..pack.policy import DEFAULT_PADDING_TOLERANCE
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, LENGTH_MAX
from ..protocol import DATA_DIR_ENV, DEFAULT_DATA_DIR
from ..ring.items import DEFAULT_MODEL, model_id
from .validator import Address, Choice, Integer, Number, Pattern, Text

INSTANCE_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NAME_WORDS = "1-64 letters, digits, '_', '.' or '-'"
RING_BYTES_MIN = 1 << 16
SEGMENT_BYTES_MIN = 1 << 20
GIB = 1 << 30
FSYNC_POLICIES = ("never", "interval", "always")


def key(default=MISSING, *, help: str, check=None, default_factory=MISSING, **more):
    """A field that is a key of the file: its default, its one-line help, its check (module docstring)."""
    return field(default=default, default_factory=default_factory, metadata={"help": help, "check": check, **more})


def toml_keys(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are keys of the file, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def key_name(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def key_field(cls, name: str) -> dataclasses.Field:
    """The field of `cls` that holds key `name`."""
    return next(f for f in toml_keys(cls) if key_name(f) == name)


def required_keys(cls) -> tuple[str, ...]:
    return tuple(key_name(f) for f in toml_keys(cls) if f.metadata.get("required"))


def seconds(default: float, help: str, *, low_open: bool = True):
    """A failure setting in seconds: > 0 (or >= 0) and <= 1e9."""
    return key(default, help=help, check=Number(0.0, 1e9, low_open=low_open))


@dataclass(frozen=True)
class BrokerConfig:
    """The top-level keys of `shmbroker.toml` and its tables (`source`: the file it came from)."""

    data_dir: str = key(help="the registry socket, the backlog segments, the ack file, the results log", check=Text(),
                        default_text=f"`${DATA_DIR_ENV}`, else `\"{DEFAULT_DATA_DIR}\"`")
    instance: str = key("main", help="names the broker's shared memory (two brokers on a host need two)",
                        check=Pattern(INSTANCE_RE, "1-32 letters, digits, '_' or '-'"))
    ingest_processes: int = key(1, help="ingest processes draining the producer rings", check=Integer(1, 64))
    # 8 MiB fits L2/L3 (measured: 16 MiB rings move 512-token records ~15 % slower); items up to ~1M tokens
    ingest_ring_bytes: int = key(8 << 20, help="each producer's ingest ring",
                                 check=Integer(RING_BYTES_MIN, 1 << 34, multiple_of=4096))
    result_ring_bytes: int = key(16 << 20, help="each producer's result ring",
                                 check=Integer(RING_BYTES_MIN, 1 << 34, multiple_of=4096))
    segment_bytes: int = key(64 << 20, help="the size of each backlog segment file",
                             check=Integer(SEGMENT_BYTES_MIN, 1 << 40, multiple_of=4096))
    fsync: str = key("interval", check=Choice(FSYNC_POLICIES),
                     help="when an appended backlog record is on disk: `never` (the kernel's writeback), `interval` "
                          "(a thread syncs every `fsync_interval_ms`), `always` (before the append returns)")
    fsync_interval_ms: float = key(5.0, help="the sync thread's period with `fsync = \"interval\"`",
                                   check=Number(0.0, 60_000.0, low_open=True))
    block_tokens: int = key(DEFAULT_BLOCK_TOKENS, help="the prefix-block size of the shape hashes, in tokens",
                            check=Integer(1, 1 << 16))
    max_wait_seconds: float = key(30.0, check=Number(0.0, 1e9, low_open=True),
                                  help="aging: an item that waited longer decides its consumer's next family "
                                       "(it is served first by a consumer that fits it)")
    padding_tolerance: float = key(DEFAULT_PADDING_TOLERANCE, check=Number(0.0, 1e6),
                                   help="padded engines: a batch's longest item is at most (1 + tolerance) x its shortest")
    decode_step_tokens: float = key(DEFAULT_STEP_TOKENS, check=Number(0.0, 1e9),
                                    help="padded engines: one decode step costs about as much as prefilling this many "
                                         "tokens; the policy batches a family alone only when the prefix it computes "
                                         "once saves more than its outputs' spread costs in steps")
    index_items: int = key(1 << 20, check=Integer(1024, 1 << 28),
                           help="items the scheduler's packing index holds; more wait on disk (`sched/waiting/`) "
                                "and enter as batches leave")
    job_hold_seconds: float = key(2.0, check=Number(0.0, 3600.0),
                                  help="while a batch job's file is still arriving, its items wait beyond the index "
                                       "at most this long when the cards have other work, so a prefix group's first "
                                       "member does not run before the others come (0: never held)")
    overflow_items: int = key(1 << 22, check=Integer(1024, 1 << 30),
                              help="items past a full index that wait in the scheduler's memory when the disk is full; "
                                   "past it the scheduler takes no more announcements, and ingest, then producers, wait")
    max_payload_bytes: int = key(1 << 20, check=Integer(1024, 64 << 20),
                                 help="the largest request payload an item may reference (a constraint's JSON schema, "
                                      "regex, grammar or choices), stored once in `payloads/` however many items "
                                      "share it")
    metrics_addr: str = key("127.0.0.1:9464", check=Address(),
                            help="the Prometheus exporter's `host:port` (loopback unless set otherwise; `[::1]:9464` "
                                 "for IPv6; port 0 picks a free one, written to `broker.json`); `\"\"`: no exporter")
    # failures: poison items, hung processes, crash loops, engines down (gpu/deliveries.py, gpu/window.py,
    # supervisor/watchdog.py)
    poison_attempts: int = key(3, check=Integer(1, 1000),
                               help="a batch a GPU process died on this often is split and its items run alone; "
                                    "an item it died on this often alone fails (`engine_error`)")
    batch_deadline_seconds: float = seconds(300.0, "a batch's deadline: this floor plus `batch_deadline_token_seconds` "
                                                   "per input and generated token, from the GPU process's last progress; "
                                                   "missed: the process is killed and its batches redelivered")
    batch_deadline_token_seconds: float = seconds(0.01, "the deadline's part per input and generated token",
                                                  low_open=False)
    engine_call_seconds: float = seconds(30.0, "one call into an engine may block this long, plus its own timeout and "
                                               "`batch_deadline_token_seconds` per token of `max_batch_tokens` (the most "
                                               "one engine step computes); past it the engine is dead: the GPU process "
                                               "exits and restarts with a fresh one, its items handed back unfailed")
    heartbeat_timeout_seconds: float = seconds(120.0, "a process whose loop did not beat this long is hung: "
                                                      "killed and restarted")
    startup_timeout_seconds: float = seconds(900.0, "... and one whose loop has not begun this long after its start "
                                                    "(an engine loading)")
    restart_backoff_max_seconds: float = seconds(5.0, "a dead process is restarted after 0.1 s, doubling after each "
                                                      "death soon after a start, up to this")
    crash_loop_restarts: int = key(5, check=Integer(1, 1 << 20),
                                   help="this many deaths in a row, each within `crash_loop_window_seconds` of its "
                                        "start: a crash loop, shown by `status`, `top` and the metrics")
    crash_loop_window_seconds: float = seconds(60.0, "the window of a crash loop's deaths")
    engine_retry_min_seconds: float = seconds(1.0, "items an engine hands back while it is down are added again after "
                                                   "this, doubling while it stays down ...")
    engine_retry_max_seconds: float = seconds(60.0, "... up to this (at least `engine_retry_min_seconds`)")
    producer_retire_seconds: float = key(30.0, check=Number(0.0, 1e9),
                                         help="a producer name with nothing left to do (producer and reader gone, "
                                              "ingest ring drained, every result acknowledged) leaves the table after "
                                              "this long, its rings unlinked")
    results_name_bytes: int = key(1 << 30, check=Integer(1 << 16, 1 << 50),
                                  help="the most of the shared results log one producer name's unread results may keep "
                                       "from being trimmed; past it they move to a log of the name's own "
                                       "(`results/behind/`)")
    consumers: tuple = key(default_factory=tuple, table="[[consumers]]", default_text="`big` and `small`",
                           help="one table per GPU process (a `ConsumerConfig` each)")
    source: str = "built-in default"  # the file read (not a key)
    tiers: tuple = key((), table="[[tiers]]", default_text="none",
                       help="what a card with at least so much memory runs (`supervise --gpus auto`; a `Tier` each)")
    gpus: tuple = key((), table="[[gpus]]", default_text="none",
                      help="cards declared for when NVML cannot tell (a `Card` each)")
    cluster: object = key(None, table="[cluster]", default_text="none (a single host)",
                          help="this broker is a node of a cluster on NATS JetStream (a `cluster.options.ClusterConfig`)")
    http: object = key(None, table="[http]", default_text="none (no HTTP API)",
                       help="the OpenAI Files and Batches API over HTTP, a role of the broker (an `HttpConfig`)")
    tokenizers: dict = key(default_factory=dict, table="[tokenizers]", default_text="none", flat=True,
                           help="each served model's tokenizer directory (its `tokenizer.json` and chat template), "
                                "keyed by model name (`default`: the default model): `submit` and `results` render "
                                "chat and text lines with it where `--tokenizer` is not given")

    def served_models(self) -> list[str]:
        """The models the consumers serve, by name, in their order (DEFAULT_MODEL for those declaring none)."""
        return list(dict.fromkeys(c.model_name or DEFAULT_MODEL for c in self.consumers))


@dataclass(frozen=True)
class Tier:
    """What a card with at least `min_memory_gib` of memory runs (one `[[tiers]]` table; gpu/tiers.py
    picks one per card). A `[[consumers]]` table has the same keys but `min_memory_gib`."""

    name: str = key(help="unique in its array of tables", check=Pattern(NAME_RE, NAME_WORDS), required=True)
    min_memory_gib: float = key(help="the smallest card the tier fits, in GiB (2^30 bytes) of total memory; "
                                     "distinct between tiers", check=Number(0.0, 1 << 20), required=True)
    engine: str = key(help="the engine adapter (its `engine_settings` below)", default=MISSING, fill="sim")
    engine_settings: object = key(help="the engine's settings, a table", default=MISSING,
                                  default_text="the engine's defaults")  # SimSettings, or the engine's own
    max_batch_size: int = key(help="the contract: items per batch (a packed engine: sequences running at once)",
                              check=Integer(1, 1 << 20), required=True)
    max_batch_tokens: int = key(help="the contract: count x longest input of a padded batch (a packed engine: "
                                     "tokens one engine step computes)", check=Integer(1, 1 << 31), required=True)
    max_input_len: int = key(help="the contract: input tokens of one item, at most `max_batch_tokens`",
                             check=Integer(1, LENGTH_MAX), required=True)
    model: str | None = key(None, help="the model name producers submit with", check=Text(),
                            default_text="none (the default model)")


@dataclass(frozen=True)
class Card:
    """One GPU: NVML's (nvidia-smi's) index, its name, its total memory (or one `[[gpus]]` table)."""

    index: int = key(help="the card's number as `nvidia-smi` shows it, unique", check=Integer(0, 1023), required=True)
    name: str = key(help="for the log", check=Text(), default=MISSING, fill="GPU")
    memory_bytes: int = key(help="its total memory in GiB", key="memory_gib", type="number", required=True,
                            check=Number(0.0, 1 << 20, low_open=True))
    uuid: str | None = None  # NVML's (not a key)


@dataclass(frozen=True)
class ConsumerConfig:
    """One GPU process: its name, its contract, the model it serves, its engine and settings."""

    name: str
    contract: Contract
    model_name: str | None
    engine: str
    engine_settings: object  # SimSettings, or the engine's own (engines/options.py)
    # the card (NVML's index) the GPU process pins itself to with CUDA_VISIBLE_DEVICES; None: not pinned
    # (set by `supervise --gpus auto`, gpu/tiers.py)
    device: int | None = None

    @classmethod
    def on_card(cls, card: Card, tier: Tier) -> ConsumerConfig:
        """`card<index>`: the tier's engine, settings and contract, pinned to the card."""
        contract = Contract(tier.max_batch_size, tier.max_batch_tokens, tier.max_input_len, model_id(tier.model))
        return cls(f"card{card.index}", contract, tier.model, tier.engine, tier.engine_settings, device=card.index)
