"""`shmbroker bench NAME --json`: the benchmarks, each against a baseline measured in the same run.

Each module is one benchmark (or one part of one) and prints one JSON object; none is imported by
the broker's processes.
"""
