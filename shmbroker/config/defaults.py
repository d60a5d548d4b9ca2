"""Defaults in one place (the TOML configuration of a running broker builds on these)."""

from __future__ import annotations

DEFAULT_CONFIG_FILE = "shmbroker.toml"
DEFAULT_INSTANCE = "main"
DEFAULT_INGEST_RING_BYTES = 8 << 20  # fits L2/L3 (measured: 16 MiB rings move 512-token records ~15 % slower); items up to ~1M tokens
DEFAULT_RESULT_RING_BYTES = 16 << 20

DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_FSYNC = "interval"
DEFAULT_FSYNC_INTERVAL_MS = 5.0
DEFAULT_MAX_WAIT_SECONDS = 30.0  # an item waiting longer decides its consumer's next family (aging, pack/policy.py)
DEFAULT_INDEX_ITEMS = 1 << 20  # items the scheduler's packing index holds; more wait in its overflow
DEFAULT_METRICS_ADDR = "127.0.0.1:9464"  # the Prometheus exporter; loopback unless configured otherwise
# the simulated engine's pace in `supervise` and `demo`: wall seconds per modeled second, so that
# consumers of different sizes split the work as real cards would (0: unpaced, as fast as the CPU)
DEFAULT_SIM_PACE_SECONDS = 0.04

# Poison items, hung processes, crash loops, engines down (README "Failures"; watchdog.py,
# gpu/deliveries.py, gpu/window.py):
# deliveries of a batch to a GPU process that died before the batch is split and its items run alone,
# and deaths on one item alone before it fails (engine_error "the engine process died on this item N times")
DEFAULT_POISON_ATTEMPTS = 3
# a batch's deadline: this floor plus DEFAULT_BATCH_DEADLINE_TOKEN_SECONDS per input and generated token,
# counted from the GPU process's last progress (a result, or work given to an idle engine)
DEFAULT_BATCH_DEADLINE_SECONDS = 300.0
DEFAULT_BATCH_DEADLINE_TOKEN_SECONDS = 0.01
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 120.0  # a process loop that has not beaten for this long is hung
DEFAULT_STARTUP_TIMEOUT_SECONDS = 900.0  # ... and one that has not beaten this long after its start
DEFAULT_RESTART_BACKOFF_MAX_SECONDS = 5.0  # restarts back off, doubling from 0.1 s up to this
DEFAULT_CRASH_LOOP_RESTARTS = 5  # this many deaths of a role ...
DEFAULT_CRASH_LOOP_WINDOW_SECONDS = 60.0  # ... within this many seconds: a crash loop (reported)
DEFAULT_ENGINE_RETRY_MIN_SECONDS = 1.0  # items an engine hands back (it is down) are retried after this,
DEFAULT_ENGINE_RETRY_MAX_SECONDS = 60.0  # doubling while it stays down, up to this
# a producer name whose producer and reader are gone, whose ingest ring is drained and whose results
# are all acknowledged leaves the producer table after this long, freeing its rings (registry.py)
DEFAULT_PRODUCER_RETIRE_SECONDS = 30.0
# items the scheduler holds in memory beyond its index (arrived while the index was full); past it
# the scheduler takes no more announcements, and ingest and then producers wait (back-pressure)
DEFAULT_OVERFLOW_ITEMS = 1 << 22
# the most of the shared results log one producer name's unread results may keep from being trimmed;
# past it that name's results move to a log of its own (results/behind/)
DEFAULT_RESULTS_NAME_BYTES = 1 << 30
# A cluster (cluster/partition.py, cluster/placement.py; figures from `bench cluster` on the trace):
# an item's partition keys on this many blocks past its family root; partitions a cluster's items
# spread over; no node owns more than (1 + epsilon) x the mean of pending tokens
DEFAULT_CLUSTER_KEY_BLOCKS = 1
DEFAULT_CLUSTER_PARTITIONS = 128
DEFAULT_CLUSTER_EPSILON = 0.05
