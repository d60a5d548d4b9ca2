"""The packing core: shapes, the index, the packer and its guard, the policy.

Pure: no shared memory, no processes, no engines. The scheduler process runs it over its own
arrays; the benchmarks and the demo run it in virtual time.
"""
