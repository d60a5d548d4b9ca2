"""`shmbroker demo`: the broker on its default configuration against the engine alone.

`run` starts a broker, feeds it (`producers`), waits for it (`broker`) and prints the comparison
(`figures`).
"""
