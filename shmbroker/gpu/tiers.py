"""Tiers: each card gets the engine and contract that suit its memory (`supervise --gpus auto`).

A machine may hold cards of different sizes, and one `[[consumers]]` list written by hand for one
machine is wrong on the next. A `[[tiers]]` table says instead what a card of at least so much
memory runs: an engine, its settings, and the contract numbers it declares. `--gpus auto` reads the
cards (nvidia-ml-py when it is installed and NVML answers, else the `[[gpus]]` the configuration
declares), gives each the tier with the largest `min_memory_gib` it reaches, and makes one consumer
per card, `card<index>`, pinned to its card (`ConsumerConfig.device`).

Card numbers are NVML's, which are nvidia-smi's and the PCI bus order. CUDA numbers cards fastest
first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so the GPU process sets that with
`CUDA_VISIBLE_DEVICES=<index>`, and the supervisor reads a `CUDA_VISIBLE_DEVICES` of indexes in
that order too. A `GPU-<uuid>` entry (or a unique prefix of one) is matched against NVML's UUIDs;
a `MIG-` entry is refused: a MIG slice's memory is not the card's, and tiers size whole cards.

This module imports nothing heavy: `pynvml` only inside `probe_nvml`. It sits above `config/settings.py`,
which declares `Tier`, `Card` and `ConsumerConfig`: `assign` gives each card its tier, and
`ConsumerConfig.on_card` builds the consumer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

from ..config.broker import GIB, Card, ConsumerConfig, Tier
from ..errors import BrokerError

__all__ = ["GIB", "Card", "Tier", "TierError", "apply_gpus_auto", "assign", "consumers_for", "detect_cards",
           "probe_nvml", "select_tier", "visible"]

log = logging.getLogger("shmbroker.tiers")


class TierError(BrokerError, ValueError):
    """No card to run on, no tier to choose from, or a card too small for every tier."""


def gib(memory_bytes: int) -> str:
    """Bytes as GiB for messages: "80 GiB", "139.8 GiB"."""
    return f"{memory_bytes / GIB:.1f}".removesuffix(".0") + " GiB"


def select_tier(card: Card, tiers) -> Tier:
    """The tier with the largest min_memory_gib that the card's memory reaches."""
    if not tiers:
        raise TierError("no [[tiers]] in the configuration: --gpus auto needs at least one")
    fits = [t for t in tiers if t.min_memory_gib * GIB <= card.memory_bytes]
    if not fits:
        smallest = min(tiers, key=lambda t: t.min_memory_gib)
        raise TierError(f"card {card.index} ({card.name}, {gib(card.memory_bytes)}) fits no tier: the smallest, "
                        f"{smallest.name!r}, needs min_memory_gib = {smallest.min_memory_gib:g}")
    return max(fits, key=lambda t: t.min_memory_gib)


def assign(cards, tiers) -> list[tuple[Card, Tier]]:
    """Each card with the tier it runs (settings.ConsumerConfig.on_card makes its consumer)."""
    return [(card, select_tier(card, tiers)) for card in cards]


def consumers_for(cards, tiers) -> tuple[ConsumerConfig, ...]:
    """One ConsumerConfig per card, `card<index>`, its tier's engine, settings and contract, pinned to the card."""
    return tuple(ConsumerConfig.on_card(card, tier) for card, tier in assign(cards, tiers))


def detect_cards() -> list[Card]:
    """The cards NVML sees and CUDA_VISIBLE_DEVICES lets through; [] (and a log line why) without NVML."""
    cards, why = probe_nvml()
    if why:
        log.info("no cards from NVML: %s", why)
    return cards


# the reasons `probe_nvml` gives when NVML itself is not there (only then are [[gpus]] read)
NVML_UNAVAILABLE = ("nvidia-ml-py (pynvml) is not installed", "NVML did not start")


def probe_nvml() -> tuple[list[Card], str]:
    """(cards, "") from NVML, or ([], why not): pynvml missing, NVML failing, nothing visible."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py (pynvml) is not installed (pip install 'shmbroker[gpu]')"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError and its many subclasses; no driver, no library
        return [], f"NVML did not start: {exc}"
    try:
        cards = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = None
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(h))
            except Exception:  # noqa: BLE001 - a UUID only matters for GPU-<uuid> entries
                pass
            cards.append(Card(i, _text(pynvml.nvmlDeviceGetName(h)), int(pynvml.nvmlDeviceGetMemoryInfo(h).total), uuid))
    except Exception as exc:  # noqa: BLE001
        return [], f"NVML failed reading the cards: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return visible(cards, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible(cards: list[Card], mask: str | None) -> tuple[list[Card], str]:
    """The cards a CUDA_VISIBLE_DEVICES value lets through, in its order; like CUDA, the list ends at
    the first entry that names no card. (cards, "") or ([], why)."""
    if mask is None:
        return (cards, "") if cards else ([], "NVML sees no card")
    out: list[Card] = []
    for entry in (e.strip() for e in mask.split(",")):
        if entry.startswith("MIG-"):
            return [], f"CUDA_VISIBLE_DEVICES={mask!r} names a MIG slice; tiers size whole cards"
        if entry.startswith("GPU-"):
            match = [c for c in cards if c.uuid and c.uuid.startswith(entry)]
            card = match[0] if len(match) == 1 else None
        elif entry.isdigit():
            card = next((c for c in cards if c.index == int(entry)), None)
        else:
            card = None
        if card is None:
            break
        if card not in out:
            out.append(card)
    return (out, "") if out else ([], f"CUDA_VISIBLE_DEVICES={mask!r} lets no card through")


def apply_gpus_auto(cfg, say: Callable[[str], None] = log.info):
    """cfg with one consumer per card (NVML's, else the declared `[[gpus]]`) in place of `[[consumers]]`.

    Says one line per card ("card 0 NVIDIA H200 139.8 GiB -> tier big (hf)"); raises TierError when
    there are no tiers, no cards, or a card that fits no tier.
    """
    if not cfg.tiers:
        raise TierError(f"{cfg.source}: --gpus auto needs at least one [[tiers]] table")
    cards, why = probe_nvml()
    source = "NVML"
    if not cards:
        if not why.startswith(NVML_UNAVAILABLE):
            # NVML works but lets no card through (CUDA_VISIBLE_DEVICES: empty, a MIG slice, an unknown
            # UUID): the declared cards would escape that mask, so there are none
            raise TierError(f"no cards: {why}")
        if not cfg.gpus:
            raise TierError(f"no cards: {why}, and {cfg.source} declares no [[gpus]]")
        cards, hidden = visible(list(cfg.gpus), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not cards:
            raise TierError(f"no cards: {why}, and of the [[gpus]] of {cfg.source}: {hidden}")
        source = f"[[gpus]] of {cfg.source} ({why})"
    say(f"{len(cards)} card(s) from {source}")
    consumers = []
    for card, tier in assign(cards, cfg.tiers):
        c = ConsumerConfig.on_card(card, tier)
        say(f"card {card.index} {card.name} {gib(card.memory_bytes)} -> tier {tier.name} ({c.engine}) as consumer {c.name}")
        consumers.append(c)
    consumers = tuple(consumers)
    return dataclasses.replace(cfg, consumers=consumers)


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
