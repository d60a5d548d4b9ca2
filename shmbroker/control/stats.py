"""Every broker process's statistics: what they are, how a process keeps them, how anyone reads them.

Each process keeps its statistics in a private int64 array (`StatsWriter.values`), adds to it on
its loop as it works (plain numpy stores, no calls per event), and publishes the whole array into
its role slot of the control segment with one seqlock publication (`ring/seqlock.py`) after each
unit of work: a batch, a drain round, a routing round. Readers (`observe/watch.py`: `shmbroker top`,
`status`, the Prometheus exporter) copy a slot with `read_role`: no locks, no RPC, and never a
torn set of values.

Counters are monotonic for the life of the broker, across restarts of the process: a restarted
process starts from the values its predecessor last published (a process killed in the middle of
a publication leaves each word at its old or its new value, both valid). Gauges are the process's
current view and are overwritten.

`STATS[kind]` lists the fields of each role kind in slot order: key (the name in snapshots and in
`shmbroker status --json`), kind, the Prometheus metric it feeds (`observe/exporter.py` prefixes
`shmbroker_`; None: not exported), a help text, constant labels, and a scale (nanoseconds are
exported as seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ring import seqlock
from ..ring.items import REFUSALS
from .roles import Kind, kind_of
from .segment import R_SEQ, R_VALUES, VALUE_WORDS, Control

COUNTER, GAUGE = "counter", "gauge"
READ_TRIES = 1000
MAX_MODELS = 16  # models the scheduler counts pending work for (one per distinct consumer model)


@dataclass(frozen=True)
class Field:
    key: str
    kind: str
    metric: str | None
    help: str
    labels: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0


def _c(key, metric, text, labels=(), scale=1.0) -> Field:
    return Field(key, COUNTER, metric, text, labels, scale)


def _g(key, metric, text, labels=(), scale=1.0) -> Field:
    return Field(key, GAUGE, metric, text, labels, scale)


NS = 1e-9

GPU = (
    _c("batches", "consumer_batches_total", "Batches the consumer ran."),
    _c("items", "consumer_items_total", "Items in the consumer's batches."),
    _c("tokens", "consumer_input_tokens_total", "Input tokens of the consumer's batches."),
    _c("padded_tokens", "consumer_padded_tokens_total",
       "Padding a padded engine computes: count x longest suffix - sum of suffixes, per batch."),
    _c("rect_tokens", "consumer_rectangle_tokens_total",
       "Rectangle tokens (count x longest suffix past the batch's common prefix), per batch."),
    _c("hit_blocks", "consumer_cache_hit_blocks_total", "Prefix blocks the engine found in its cache."),
    _c("reused_tokens", "consumer_prefix_reused_tokens_total",
       "Prefix tokens the engine served from a cache instead of computing them."),
    _c("queried_blocks", "consumer_cache_queried_blocks_total", "Prefix blocks the engine looked up."),
    _c("shape_switches", "consumer_shape_switches_total", "Consecutive batches of different prefix families."),
    _c("excess_shape_switches", "consumer_excess_shape_switches_total",
       "Switches back to a family the consumer had already served (switches - (families - 1))."),
    _c("families", "consumer_families_total", "Prefix families the consumer served."),
    _c("guard_violations", "consumer_guard_refusals_total",
       "Batches the consumer's shape guard found not shape-pure or over its contract."),
    _c("ok", "consumer_ok_items_total", "Items the engine completed."),
    _c("too_long", "consumer_failed_items_total", "Items failed back by the consumer.", (("reason", "too_long"),)),
    _c("invalid", "consumer_failed_items_total", "Items failed back by the consumer.", (("reason", "invalid"),)),
    _c("engine_errors", "consumer_failed_items_total", "Items failed back by the consumer.",
       (("reason", "engine_error"),)),
    _c("corrupt", "consumer_failed_items_total", "Items failed back by the consumer.", (("reason", "corrupt"),)),
    _c("busy_ns", "consumer_engine_busy_seconds_total",
       "Seconds the GPU process spent on batches, from taking one to releasing it (engine and consumer loop).",
       scale=NS),
    _c("idle_ns", "consumer_engine_idle_seconds_total", "Seconds the consumer waited with no batch.", scale=NS),
    _c("batch_wait_ns", "consumer_batch_wait_seconds_total",
       "Seconds batches sat packed in the consumer's ring before it took them.", scale=NS),
    _c("engine_own_ns", "consumer_engine_own_seconds_total",
       "Seconds the engine reported for its batches: its own measured time (hf, vllm, trtllm, openai), "
       "the cost model's (sim).", scale=NS),
    _g("last_family", None, "The family of the consumer's last batch (a restart resumes from it)."),
    _c("engine_retries", "consumer_engine_retried_items_total",
       "Items an engine handed back while it was down (unreachable, failing), retried after a back-off."),
    _g("engine_down", "consumer_engine_down", "1 while the consumer's engine is down: its items wait for a retry."),
    _c("redelivered", "consumer_redelivered_batches_total",
       "Batch records a GPU process took again because its predecessor died holding them."),
    _c("split_batches", "consumer_split_batches_total",
       "Batches split to run their items alone: a GPU process died on them poison_attempts times."),
    _c("poisoned", "consumer_poisoned_items_total",
       "Items failed (engine_error) because the engine process died on each alone poison_attempts times."),
    _c("engine_deaths", "consumer_engine_deaths_total",
       "Engines that died (EngineDead, a call past its deadline, its processes gone): each a fresh GPU process."),
    _g("engine_restart_ns", "consumer_engine_restart_seconds",
       "The last engine death's restart: seconds from the death to the fresh engine's first result.", scale=NS),
    _g("engine_load_ns", "consumer_engine_load_seconds",
       "Seconds the GPU process took from its start to its engine loaded (process start and model load).",
       scale=NS),
)

INGEST = (
    _c("items", "ingest_items_total", "Items appended to the backlog."),
    _c("tokens", "ingest_tokens_total", "Tokens appended to the backlog."),
    _c("bytes", "ingest_appended_bytes_total", "Bytes appended to the backlog's segment files."),
    _c("batches", "ingest_batches_total", "Drain rounds that appended records."),
    _c("disk_full", "ingest_disk_full_total", "Appends refused by a full disk (retried after a back-off)."),
    # one per ring.items.REFUSALS, in its order (ingest.I_REFUSED), then rings_closed
    *(_c(f"refused_{reason}", "ingest_refused_records_total",
         "Ring records refused alone (not appended) because a field the producer wrote failed its check.",
         (("reason", reason),)) for reason in REFUSALS),
    _c("rings_closed", "ingest_rings_closed_total",
       "Producers' ingest rings closed because their frame was broken (a corrupt record)."),
)

SCHED = (
    _c("indexed_items", "sched_indexed_items_total", "Items the scheduler put into the packing index."),
    _c("indexed_tokens", "sched_indexed_tokens_total", "Tokens the scheduler put into the packing index."),
    _c("batches", "sched_batches_total", "Batch records the scheduler pushed to consumers."),
    _c("items", "sched_dispatched_items_total", "Items the scheduler packed into batches."),
    _c("rejected_empty", "rejected_items_total", "Items failed back at intake.", (("reason", "empty"),)),
    _c("rejected_no_consumer", "rejected_items_total", "Items failed back at intake.", (("reason", "no_consumer"),)),
    _c("rejected_too_long", "rejected_items_total", "Items failed back at intake.", (("reason", "too_long"),)),
    _c("cancelled", "sched_cancelled_items_total", "Items of cancelled jobs answered `cancelled` before they were dispatched."),
    # exported per model (observe/exporter.py: shmbroker_backlog_pending_items{model}), from the words below
    _g("pending_items", None, "Items waiting for a batch (in the index or beyond it)."),
    _g("pending_tokens", None, "Tokens waiting for a batch (in the index or beyond it)."),
    _g("overflow_items", "sched_overflow_items",
       "Items waiting in the scheduler's memory for room in the packing index (read back from disk, "
       "or come while the disk was full: at most overflow_items of those)."),
    _g("families", "backlog_families", "Prefix families in the packing index."),
    _g("oldest_ns", None, "CLOCK_MONOTONIC time the oldest waiting item entered the scheduler (0: none)."),
    _g("num_models", None, "Models with per-model pending counts below."),
    _g("recovered_corrupt", "sched_recovered_corrupt_items",
       "Backlog records the scheduler's start found failing their CRC, answered `corrupt` (they name their item)."),
    _g("recovered_unnamed_corrupt", "sched_recovered_unnamed_corrupt_records",
       "Backlog records the scheduler's start found lost to damage that names no item (no result can be sent)."),
    _c("held_back", "sched_held_back_total",
       "Times the scheduler left announcements in their rings because its overflow was full (back-pressure)."),
    _g("waiting_items", "sched_waiting_items",
       "Items waiting on disk (not in memory) for room in the packing index: recovered by a start, or come while it was full."),
) + tuple(_g(f"model{m}_items", None, "") for m in range(MAX_MODELS)) \
  + tuple(_g(f"model{m}_tokens", None, "") for m in range(MAX_MODELS))

RESULTS = (
    _c("results", "results_total", "Results appended to the durable results log."),
    _c("delivered", "results_delivered_total", "Results pushed to producers' result rings."),
    _c("acked", "results_acked_items_total", "Backlog items acked (done)."),
    _c("parked", "results_parked_total", "Results parked for an absent or full producer."),
    _c("log_bytes", "results_log_bytes_total", "Bytes appended to the results log."),
    _c("acks_saved", "results_checkpoints_total", "Ack and cursor checkpoints saved."),
    _c("disk_full", "results_disk_full_total", "Results-log appends refused by a full disk (retried)."),
    _g("parked_now", "results_parked_now", "Results parked now."),
    _c("log_bad_records", "results_log_bad_records_total",
       "Damaged records skipped when the results log was replayed (a torn tail is not counted)."),
    _c("log_bad_bytes", "results_log_bad_bytes_total", "Bytes of the results log skipped as damaged."),
    _c("corrupt_notices", "results_corrupt_notices_total",
       "Items told `corrupt` because their result record was damaged in the results log."),
    _c("readers", "results_readers_total", "Result readers set up (a producer attaching to read its results)."),
    _c("redelivered", "results_redelivered_total",
       "Results pushed again because the reader that had popped them never acknowledged them."),
    _g("names_behind", "results_names_behind",
       "Producer names read so far behind (past results_name_bytes) that their results wait in a log of their own."),
    _g("behind_bytes", "results_behind_bytes", "Bytes of results waiting in the logs of names read far behind."),
    _c("names_moved", "results_names_moved_total", "Times a producer name read far behind was moved to a log of its own."),
)

BRIDGE = (  # a cluster node's bridge (cluster/bridge.py), one per node
    _c("pulled", "bridge_pulled_items_total", "Prompts the bridge pulled from the cluster's prompts stream."),
    _c("submitted", "bridge_submitted_items_total", "Pulled prompts submitted to this broker."),
    _c("published", "bridge_published_results_total", "Results stored in the cluster's results stream."),
    _c("acked", "bridge_acked_items_total", "Prompts acked to JetStream (each after its result was stored)."),
    _c("refused", "bridge_refused_messages_total", "Prompt messages that did not decode (answered invalid when they name their item)."),
    _c("invalid", "bridge_invalid_items_total", "Prompts this broker refused at submit (answered invalid)."),
    _c("fenced", "bridge_fenced_items_total", "Staged prompts forgotten because their partition's lease was lost."),
    _c("naked", "bridge_naked_items_total", "Staged prompts handed back to JetStream (a drain's deadline, a stop)."),
    _c("unknown_results", "bridge_unknown_results_total",
       "Local results of prompts this bridge no longer stages (fenced, or staged by an earlier bridge): dropped."),
    _c("publish_errors", "bridge_publish_errors_total", "Result publishes that failed (retried)."),
    _c("pull_errors", "bridge_pull_errors_total",
       "Pulls that failed (a server going away, a consumer's leader moving; retried after a pause)."),
    _c("in_progress", "bridge_in_progress_total", "In-progress acks that kept staged prompts from redelivery."),
    _c("leases_taken", "bridge_leases_taken_total", "Partition leases this node took."),
    _c("leases_lost", "bridge_leases_lost_total", "Partition leases this node lost (a renewal found another owner)."),
    _c("leases_released", "bridge_leases_released_total", "Partition leases this node gave up (placed elsewhere, a stop)."),
    _c("nats_reconnects", "bridge_nats_reconnects_total", "Reconnections to the NATS servers."),
    _g("partitions", "bridge_partitions", "Partitions this node leases now."),
    _g("draining", "bridge_draining_partitions", "Leased partitions placed elsewhere, being drained."),
    _g("live_nodes", "bridge_live_nodes", "Nodes whose heartbeat this node sees."),
    _g("staged_items", "bridge_staged_items", "Prompts pulled and not yet answered (the staging window)."),
    _g("stream_items", "bridge_stream_items", "Messages in the prompts stream on this node's partitions (JetStream's pending)."),
    _g("connected", "bridge_connected", "1 while the bridge is connected to a NATS server."),
)

STATS = {Kind.GPU: GPU, Kind.INGEST: INGEST, Kind.SCHED: SCHED, Kind.RESULTS: RESULTS, Kind.BRIDGE: BRIDGE}
for _kind, _fields in STATS.items():
    assert len(_fields) <= VALUE_WORDS, _kind
    assert len({f.key for f in _fields}) == len(_fields), _kind


def slot_of(kind: str, key: str) -> int:
    """A field's word in its role's values (`StatsWriter.values[slot_of(...)]`)."""
    for i, f in enumerate(STATS[kind]):
        if f.key == key:
            return i
    raise KeyError(f"{kind} has no statistic {key!r}")


class StatsWriter:
    """A process's statistics: `values` private, `publish()` into its role slot."""

    def __init__(self, control: Control, role: int):
        self.fields = STATS[kind_of(control.roles[role])]
        self.words = control.role(role)
        self.values = np.zeros(len(self.fields), np.int64)
        resumed = np.zeros(VALUE_WORDS, np.int64)
        if not seqlock.read(self.words, R_SEQ, R_VALUES, resumed, READ_TRIES):
            resumed[:] = self.words[R_VALUES:]  # a predecessor killed mid-publication: each word old or new
        self.values[:] = resumed[: self.values.size]
        self.index = {f.key: i for i, f in enumerate(self.fields)}
        self.publish()  # at once: a predecessor killed mid-publication left the slot unreadable

    def publish(self) -> None:
        seqlock.publish(self.words, R_SEQ, R_VALUES, self.values)

    def __getitem__(self, key: str) -> int:
        return int(self.values[self.index[key]])


def read_role(control: Control, r: int, out: np.ndarray | None = None) -> dict[str, int] | None:
    """Role r's statistics by key, from one publication; None when the slot stayed mid-publication."""
    fields = STATS.get(kind_of(control.roles[r]), ())
    if not fields:
        return {}
    out = np.empty(len(fields), np.int64) if out is None else out[: len(fields)]
    if not seqlock.read(control.role(r), R_SEQ, R_VALUES, out, READ_TRIES):
        return None
    return {f.key: int(v) for f, v in zip(fields, out.tolist())}
