"""The producer client: what a producer process imports (`from shmbroker import Producer`).

Runs inside the user's own processes, never in the broker: `producer` submits token-id prompts into
the producer's ingest ring in shared memory without blocking on a GPU, `checks` refuses bad
arguments before anything is written, `reader` takes results off the result ring once each and
acknowledges them, and `seen` is the duplicate window over sequence numbers. It reaches the
broker only through the front door's socket protocol and the rings it hands out.
"""
