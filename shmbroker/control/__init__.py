"""The control segment: one shared-memory block that every broker process writes its own part of.

`segment` lays out the producer table and one liveness-and-counters slot per process; `roles`
declares the broker's processes once (kind, place, name); `stats` is every process's statistics,
published under a seqlock and read by anyone without a lock; `deaths` writes why a process died into
its slot and reads it back (the supervisor's watchdog, `status`).
"""
