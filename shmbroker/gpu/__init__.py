"""The GPU processes (`gpu-NAME`, one per card): read batches, run an engine, write results.

`consumer` is the process's loop; `window` keeps a continuous engine full within its contract;
`core` runs one batch on an engine with failures kept to their items; `segments` reads records
zero-copy from the backlog; `deliveries` and `backoff` handle poison items and engines that are
down; `tiers` maps a card's memory to an engine and contract (`supervise --gpus auto`).
"""
