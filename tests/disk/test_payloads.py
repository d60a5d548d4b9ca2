"""The payload store: a payload stored once under its digest, durably and owner-only; one whose bytes
rotted, or were cut, is refused as corrupt, never read as another."""

from __future__ import annotations

import stat

import pytest

from shmbroker.disk.payloads import HEADER, PayloadCorrupt, PayloadError, PayloadMissing, PayloadStore, PayloadTooLarge
from shmbroker.request.structured import digest_of


def test_a_payload_is_stored_once_and_reads_back(tmp_path):
    store = PayloadStore(tmp_path, 1 << 16)
    payload = b'{"type":"object","properties":{"a":{"type":"integer"}}}'
    digest = store.put(payload)
    assert digest == digest_of(payload) and store.get(digest) == payload
    path = store.path(digest)
    before = path.stat().st_ino
    assert store.put(payload) == digest and path.stat().st_ino == before  # stored once: not written again
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(store.dir.stat().st_mode) == 0o700
    assert len(list(store.dir.iterdir())) == 1


def test_a_damaged_payload_is_corrupt_and_a_sound_put_replaces_it(tmp_path):
    store = PayloadStore(tmp_path, 1 << 16)
    payload = b"[a-z]{3,8}" * 50
    digest = store.put(payload)
    raw = store.path(digest).read_bytes()
    for pos in (0, 9, HEADER.size - 1, HEADER.size, len(raw) - 1):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        store.path(digest).write_bytes(bytes(bad))
        with pytest.raises(PayloadCorrupt):
            store.get(digest)
    store.path(digest).write_bytes(raw[:-3])
    with pytest.raises(PayloadCorrupt):
        store.get(digest)
    assert store.put(payload) == digest and store.get(digest) == payload  # a sound copy replaces it
    with pytest.raises(PayloadMissing):
        store.get(digest_of(b"never stored"))


def test_a_payload_over_the_limit_or_empty_is_refused(tmp_path):
    store = PayloadStore(tmp_path, 1024)
    with pytest.raises(PayloadTooLarge, match="max_payload_bytes = 1024"):
        store.put(b"x" * 1025)
    with pytest.raises(PayloadError, match="empty"):
        store.put(b"")
    assert not store.dir.exists()


def test_many_threads_storing_one_payload_at_once_all_get_its_digest(tmp_path):
    """The registry answers each producer on a thread: two storing one schema at once must not replace
    one file through one temporary name under each other."""
    from concurrent.futures import ThreadPoolExecutor

    store = PayloadStore(tmp_path, 1 << 16)
    payload = b'{"type":"object"}' * 100
    with ThreadPoolExecutor(8) as pool:
        digests = list(pool.map(lambda _: store.put(payload), range(64)))
    assert set(digests) == {digest_of(payload)} and store.get(digests[0]) == payload
