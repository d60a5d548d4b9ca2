"""Defaults in one place (the TOML configuration of a running broker builds on these)."""

from __future__ import annotations

import os

DEFAULT_DATA_DIR = "shmbroker-data"
DEFAULT_INSTANCE = "main"
DEFAULT_SUBMIT_TIMEOUT_SECONDS = 10.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 5.0
DEFAULT_INGEST_RING_BYTES = 8 << 20  # fits L2/L3 (measured: 16 MiB rings move 512-token records ~15 % slower); items up to ~1M tokens
DEFAULT_RESULT_RING_BYTES = 16 << 20


def data_dir(explicit: str | os.PathLike | None = None) -> str:
    """The data directory: the argument, else $SHMBROKER_DATA_DIR, else ./shmbroker-data."""
    if explicit is not None:
        return os.fspath(explicit)
    return os.environ.get("SHMBROKER_DATA_DIR", DEFAULT_DATA_DIR)

DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_FSYNC = "interval"
DEFAULT_FSYNC_INTERVAL_MS = 5.0
DEFAULT_METRICS_ADDR = "127.0.0.1:9464"  # the Prometheus exporter; loopback unless configured otherwise
# the simulated engine's pace in `supervise` and `demo`: wall seconds per modeled second, so that
# consumers of different sizes split the work as real cards would (0: unpaced, as fast as the CPU)
DEFAULT_SIM_PACE_SECONDS = 0.04
