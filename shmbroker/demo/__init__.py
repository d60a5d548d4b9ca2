"""`shmbroker demo`: the broker on its built-in consumers against the engine alone, on generation.

`run` starts a broker, feeds it (`producers`), waits for it (`broker`), runs the same workload
through the engines alone and FIFO feeding in virtual time (`figures`) and prints the comparison
(`summary`).
"""
