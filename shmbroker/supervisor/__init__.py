"""The supervisor process: `shmbroker supervise` creates the shared memory, forks every other process,
watches and restarts them.

`supervise` is the process itself; `wiring` declares the rings and doorbells between the roles and
what each child runs; `watchdog` bounds restarts, finds crash loops and hung loops; `salvage` moves
what a dead broker's ingest rings still hold into the backlog before their shared memory is swept;
`warmup` loads every numba kernel once so that forked children never compile.
"""
