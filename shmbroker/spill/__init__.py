"""The backlog on disk: append-only segment files, memory-mapped; their records, recovery of a torn
tail, ack cursors and reclaim. Written by the ingest processes, read by the scheduler and the GPU
processes, acked by the results process.
"""
