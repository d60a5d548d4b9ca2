"""Shared memory and its rings, used by every process: byte layouts, numba atomics, SPSC rings, the
lifecycle of POSIX shared-memory segments (only the supervisor creates and unlinks them), wire
records between processes and the CRC32C of records inside kernels.
"""
