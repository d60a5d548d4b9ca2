"""shmbroker: a token-aware work broker for GPU LLM inference, over shared memory.

`from shmbroker import Producer` is the producer client; the rest of the
package is the broker. Names are loaded on first use, so importing the
package alone stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["BrokerError", "Full", "NotRunning", "PeerDead", "Producer", "Result"]


def __getattr__(name: str):
    if name in ("Producer", "Result"):
        from .client import producer as client

        return getattr(client, name)
    if name in ("BrokerError", "Full", "NotRunning", "PeerDead"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'shmbroker' has no attribute {name!r}")
