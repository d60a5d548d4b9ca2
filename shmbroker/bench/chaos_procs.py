"""The load of `bench chaos`: producer processes, short-lived names and result readers.

`prompt(seed, producer, k)` is the one source of every item's prompt, so the score can recompute
what the simulated engine must have answered.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time

import numpy as np

VOCAB = 32_000
SHORT_NAME_SECONDS = 0.5


def prompt(seed: int, producer: int, k: int) -> tuple[np.ndarray, int]:
    """(tokens, max_new_tokens) of item k of producer `producer`: a shared prefix for half of them."""
    rng = np.random.default_rng([seed, producer, k])
    length = int(rng.integers(1, 700))
    tokens = rng.integers(0, VOCAB, length, dtype=np.uint32)
    if k % 2 and length > 64:
        tokens[:64] = np.random.default_rng([seed, k % 7]).integers(0, VOCAB, 64, dtype=np.uint32)
    return tokens, 1 + k % 8


def produce(name: str, index: int, data_dir: str, seed: int, stop, accepted_path: str) -> None:
    """Submit prompts until `stop`; one line "<item id> <k>" per accepted item."""
    from ..client.producer import Producer
    from ..errors import BrokerError, Full

    producer = None
    k = 0
    with open(accepted_path, "w") as out:
        while not stop.is_set():
            try:
                if producer is None:
                    producer = Producer(name, data_dir=data_dir, timeout_seconds=2.0, connect_timeout_seconds=30.0)
                tokens, max_new = prompt(seed, index, k)
                item = producer.submit(tokens, max_new_tokens=max_new)
                out.write(f"{item} {k}\n")
                k += 1
                if k % 16 == 0:
                    out.flush()
                    time.sleep(0.01)  # a steady stream, not a flood: the readers and the killer share the cores
            except Full:
                time.sleep(0.05)
            except (BrokerError, OSError, RuntimeError):  # RuntimeError: a ring side still claimed
                if producer is not None:
                    try:
                        producer.close()
                    except Exception:
                        pass
                producer = None
                time.sleep(0.1)
        if producer is not None:
            producer.close()


def short_lived(data_dir: str, seed: int, stop, accepted_path: str) -> None:
    """A new name every SHORT_NAME_SECONDS, one item each: "<name> <item id> <k>" per line."""
    from ..client.producer import Producer
    from ..errors import BrokerError

    k = 0
    with open(accepted_path, "w") as out:
        while not stop.is_set():
            name = f"short-{k}-{secrets.token_hex(3)}"
            tokens, max_new = prompt(seed, 1000, k)
            try:
                with Producer(name, data_dir=data_dir, timeout_seconds=2.0, connect_timeout_seconds=5.0) as p:
                    item = p.submit(tokens, max_new_tokens=max_new)
                out.write(f"{name} {item} {k}\n")
                out.flush()
            except (BrokerError, OSError):
                pass
            k += 1
            stop.wait(SHORT_NAME_SECONDS)


class Reader(threading.Thread):
    """`shmbroker results --name N --out F` again and again; `kill()` SIGKILLs the current run."""

    def __init__(self, name: str, data_dir: str, out: str):
        super().__init__(daemon=True)
        self.cmd = [sys.executable, "-m", "shmbroker.cli", "results", "--name", name, "--data-dir", data_dir,
                    "--out", out, "--timeout", "0.5"]
        self.proc: subprocess.Popen | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.proc.wait()
            self.halt.wait(0.2)

    def kill(self) -> bool:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        proc.kill()
        return True

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
