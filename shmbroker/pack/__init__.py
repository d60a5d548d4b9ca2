"""The packing core: shapes, the index, the packer and its guard, the policy.

Pure: no shared memory, no processes, no engines. The scheduler process
(a later issue) runs it over arrays that may live in shared memory.
"""
