"""Files on disk: the durable-I/O seam (`durable`: every write, fsync, rename and unlink that must
survive a crash goes through it, so tests can inject faults and simulate power loss) and exclusive
lock files (`lockfile`: one live holder, released by the kernel when it dies).
"""
