"""Workloads: what the benchmarks, the demo and `submit --trace` feed the broker.

Run in the benchmarks', the demo's and `submit`'s own processes, never in the broker's.

`synthetic` makes seeded prompt sets of known shape; `trace` replays the Mooncake conversation trace
(its hash ids become token blocks); `packsim` runs the packer against simulated engines in virtual
time, fed by one of `feeders` (the packer, FIFO, the engine alone): the offline half of `bench pack`
and of the demo's FIFO comparison. None of them touches shared memory or a running broker.
"""

FAMILIES = ("templates", "chains", "oneoffs", "mixed", "spread", "spread-grouped")  # families.py's workloads
