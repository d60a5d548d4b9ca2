"""The producer client: what a producer process imports (`from shmbroker import Producer`).

Runs inside the user's own processes, never in the broker. `producer` is the `Producer` a user
holds; it is a `connection` (the front door's connect handshake and the two rings it hands out)
and two sides it delegates to: `submitter` pushes token-id prompts into the ingest ring in shared
memory without blocking on a GPU, and `reader` takes results off the result ring once each and
acknowledges them. `checks` refuses bad arguments before anything is written, and `seen` is the
duplicate window over sequence numbers. The client reaches the broker only through the front
door's socket protocol (`protocol`) and the rings it hands out.
"""
