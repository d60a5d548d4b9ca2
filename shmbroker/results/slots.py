"""The results role's statistics by name: each counter's and gauge's word in the role's values.

The fields themselves (key, metric, help) are declared once, in `control/stats.py` (STATS["results"]);
this module names their positions for the results process's modules, so that no code indexes the
values by a bare number.
"""

from __future__ import annotations

from ..control.stats import STATS, slot_of

NUM_SLOTS = len(STATS["results"])

C_RESULTS = slot_of("results", "results")  # results appended to the log (routed)
C_DELIVERED = slot_of("results", "delivered")  # pushed on a producer's result ring
C_ACKED = slot_of("results", "acked")  # backlog items acked
C_PARKED = slot_of("results", "parked")  # parked for a producer not connected
C_LOG_BYTES = slot_of("results", "log_bytes")
C_CHECKPOINTS = slot_of("results", "acks_saved")
C_DISK_FULL = slot_of("results", "disk_full")
G_PARKED_NOW = slot_of("results", "parked_now")
C_BAD_RECORDS = slot_of("results", "log_bad_records")
C_BAD_BYTES = slot_of("results", "log_bad_bytes")
C_NOTICES = slot_of("results", "corrupt_notices")
C_READERS = slot_of("results", "readers")
C_REDELIVERED = slot_of("results", "redelivered")
G_BEHIND = slot_of("results", "names_behind")
G_BEHIND_BYTES = slot_of("results", "behind_bytes")
C_MOVED = slot_of("results", "names_moved")
