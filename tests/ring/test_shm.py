"""Shared-memory lifecycle on real /dev/shm: modes, rollback, cross-process sight, crash sweep."""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import secrets
import signal
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from support.harness import DEV_SHM, sweep_shm

from shmbroker.ring.owner import Manifest, Owner
from shmbroker.ring.shm import Doorbell, Segment, make_name

pytestmark = pytest.mark.timeout(30)

JOIN_SECONDS = 10.0


def segment_path(name: str) -> Path:
    return DEV_SHM / name[1:]


def doorbell_path(name: str) -> Path:
    return DEV_SHM / ("sem." + name[1:])


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def instance():
    """A fresh instance name; after the test, nothing of it may be left in /dev/shm."""
    name = f"t{secrets.token_hex(4)}"
    yield name
    left = sweep_shm(name)
    assert left == [], f"test left {left}"


def run_forked(target, *args) -> None:
    """Run target(*args) in a forked child; fail unless it exits 0 in time."""
    child = mp.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(JOIN_SECONDS)
    assert child.exitcode == 0, f"child exit code {child.exitcode}"


def check_and_answer(name: str) -> None:
    """Child side of the round trip: see the parent's bytes, write an answer."""
    seg = Segment.attach(name)
    assert seg.creator is False
    assert np.array_equal(seg.buf[:256], np.arange(256, dtype=np.uint8))
    seg.buf[256:512] = 7
    seg.close()


# --- names -----------------------------------------------------------------


def test_make_name_carries_instance_token_and_role():
    a = make_name("inst-1", "ring_0")
    b = make_name("inst-1", "ring_0")
    assert a.startswith("/shmb.inst-1.") and a.endswith(".ring_0")
    assert len(a.split(".")[2]) == 12
    assert a != b


@pytest.mark.parametrize(
    "instance, role",
    [("", "r"), ("i", ""), ("a.b", "r"), ("i", "a/b"), ("a b", "r"), ("i", "r\n"), ("é", "r"), ("x" * 200, "r")],
)
def test_invalid_names_refused(instance, role):
    with pytest.raises(ValueError):
        make_name(instance, role)


def test_owner_refuses_invalid_instance(tmp_path):
    with pytest.raises(ValueError):
        Owner(tmp_path, "bad.instance")


# --- segments --------------------------------------------------------------


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_round_trip_across_processes(tmp_path, instance, start_method):
    with Owner(tmp_path, instance) as owner:
        seg = owner.segment("data", 4096)
        assert seg.creator and seg.size == 4096 and seg.buf.dtype == np.uint8 and seg.buf.shape == (4096,)
        seg.buf[:256] = np.arange(256, dtype=np.uint8)
        child = mp.get_context(start_method).Process(target=check_and_answer, args=(seg.name,))
        child.start()
        child.join(JOIN_SECONDS)
        assert child.exitcode == 0
        assert (seg.buf[256:512] == 7).all()
        assert (seg.buf[512:] == 0).all()


def test_segment_and_doorbell_files_are_0600(instance):
    old_umask = os.umask(0)
    try:
        seg = Segment.create(make_name(instance, "seg"), 100)
        bell = Doorbell.create(make_name(instance, "bell"))
    finally:
        os.umask(old_umask)
    try:
        assert mode_of(segment_path(seg.name)) == 0o600
        assert mode_of(doorbell_path(bell.name)) == 0o600
    finally:
        for obj in (seg, bell):
            obj.close()
            obj.unlink()


def test_exclusive_create_of_existing_name_fails_and_keeps_the_original(instance):
    seg = Segment.create(make_name(instance, "seg"), 64)
    bell = Doorbell.create(make_name(instance, "bell"))
    try:
        with pytest.raises(FileExistsError, match=seg.name):
            Segment.create(seg.name, 64)
        with pytest.raises(FileExistsError, match=bell.name):
            Doorbell.create(bell.name)
        assert segment_path(seg.name).exists()  # the failed create did not roll back someone else's
        assert doorbell_path(bell.name).exists()
    finally:
        for obj in (seg, bell):
            obj.close()
            obj.unlink()


def test_attach_missing_raises_file_not_found(instance):
    name = make_name(instance, "missing")
    with pytest.raises(FileNotFoundError, match=name):
        Segment.attach(name)
    with pytest.raises(FileNotFoundError, match=name):
        Doorbell.attach(name)


def test_size_must_be_positive(instance):
    for size in (0, -1):
        with pytest.raises(ValueError):
            Segment.create(make_name(instance, "seg"), size)


def test_close_is_idempotent_and_tolerates_live_views(instance):
    with Segment.create(make_name(instance, "seg"), 4096) as seg:
        seg.buf[:4] = 9
        view = seg.buf[:4]
        seg.close()  # a numpy view is still exported: no BufferError
        seg.close()
        with pytest.raises(ValueError, match="closed"):
            _ = seg.buf
        assert (view == 9).all()  # the mapping lives on until the view dies
        del view
        seg.unlink()
        seg.unlink()  # already gone is fine
    assert not segment_path(seg.name).exists()

    bell = Doorbell.create(make_name(instance, "bell"))
    bell.close()
    bell.close()
    with pytest.raises(ValueError, match="closed"):
        bell.ring()
    bell.unlink()
    bell.unlink()


def test_unlink_of_a_name_already_removed_elsewhere_is_fine(instance):
    seg = Segment.create(make_name(instance, "seg"), 64)
    seg.close()
    segment_path(seg.name).unlink()
    seg.unlink()


def test_only_the_creator_unlinks(instance):
    seg = Segment.create(make_name(instance, "seg"), 64)
    bell = Doorbell.create(make_name(instance, "bell"))
    try:
        for attached in (Segment.attach(seg.name), Doorbell.attach(bell.name)):
            assert attached.creator is False
            with pytest.raises(PermissionError, match="only the creator unlinks"):
                attached.unlink()
            attached.close()
        assert segment_path(seg.name).exists() and doorbell_path(bell.name).exists()
    finally:
        for obj in (seg, bell):
            obj.close()
            obj.unlink()


def test_failed_mmap_rolls_back_the_segment(tmp_path, instance, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("injected mmap failure")

    monkeypatch.setattr(mmap, "mmap", fail)
    name = make_name(instance, "seg")
    with pytest.raises(OSError, match="injected"):
        Segment.create(name, 4096)
    assert not segment_path(name).exists()

    with Owner(tmp_path, instance) as owner:  # the owner also drops the manifest entry
        with pytest.raises(OSError, match="injected"):
            owner.segment("seg", 4096)
        assert owner.manifest.names() == {"segments": [], "doorbells": []}
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError):
        Segment.attach(name)


# --- doorbells -------------------------------------------------------------


def test_doorbell_wakes_a_sleeper_in_another_process(instance):
    bell = Doorbell.create(make_name(instance, "bell"))
    ready_r, ready_w = os.pipe()

    def sleeper() -> None:
        mine = Doorbell.attach(bell.name)
        os.write(ready_w, b"r")
        start = time.monotonic()
        woken = mine.sleep(5.0)
        assert woken and time.monotonic() - start < 2.0
        mine.close()

    try:
        child = mp.get_context("fork").Process(target=sleeper)
        child.start()
        assert os.read(ready_r, 1) == b"r"
        time.sleep(0.05)
        bell.ring()
        child.join(JOIN_SECONDS)
        assert child.exitcode == 0
    finally:
        os.close(ready_r)
        os.close(ready_w)
        bell.close()
        bell.unlink()


def test_sleep_times_out_returning_false(instance):
    with Doorbell.create(make_name(instance, "bell")) as bell:
        start = time.monotonic()
        assert bell.sleep(0.1) is False
        elapsed = time.monotonic() - start
        assert 0.09 <= elapsed < 1.0
        start = time.monotonic()
        assert bell.sleep(0) is False
        assert bell.sleep(-1) is False
        assert time.monotonic() - start < 0.05
        bell.ring()
        bell.ring()
        assert bell.sleep(0) is True  # each ring answers one sleep
        assert bell.sleep(0.5) is True
        assert bell.sleep(0) is False
        bell.unlink()


# --- manifest and owner ----------------------------------------------------


def test_data_dir_is_0700_and_manifest_is_0600(tmp_path, instance):
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)
    with Owner(data_dir, instance) as owner:
        owner.doorbell("bell")
        assert mode_of(data_dir) == 0o700
        assert mode_of(data_dir / "shm-manifest.json") == 0o600
    assert mode_of(Manifest(tmp_path / "new" / "dir").data_dir) == 0o700


def test_owner_records_before_create_and_cleans_up(tmp_path, instance, monkeypatch):
    owner = Owner(tmp_path, instance)
    real_create = Segment.create.__func__
    listed_at_create = []

    def spy(cls, name, size):
        listed_at_create.append(name in owner.manifest.names()["segments"])
        return real_create(cls, name, size)

    monkeypatch.setattr(Segment, "create", classmethod(spy))
    seg = owner.segment("a", 64)
    bell = owner.doorbell("b")
    other = owner.segment("c", 64)
    assert listed_at_create == [True, True]
    record = json.loads((tmp_path / "shm-manifest.json").read_text())
    assert record == {"owner_pid": os.getpid(), "segments": [seg.name, other.name], "doorbells": [bell.name]}

    owner.release(other)
    assert not segment_path(other.name).exists()
    assert owner.manifest.names() == {"segments": [seg.name], "doorbells": [bell.name]}
    with pytest.raises(ValueError):
        owner.release(other)

    owner.close()
    owner.close()
    assert not segment_path(seg.name).exists() and not doorbell_path(bell.name).exists()
    assert owner.manifest.names() == {"segments": [], "doorbells": []}
    with pytest.raises(ValueError, match="closed"):
        owner.segment("late", 64)


def crashing_owner(data_dir: Path, instance: str, names_w: int) -> None:
    owner = Owner(data_dir, instance)
    names = [owner.segment("ring0", 4096).name, owner.segment("ring1", 4096).name]
    names += [owner.doorbell("data").name, owner.doorbell("space").name]
    os.write(names_w, json.dumps(names).encode() + b"\n")
    time.sleep(JOIN_SECONDS)  # killed long before this


def test_restarted_owner_sweeps_what_a_killed_one_left(tmp_path, instance):
    names_r, names_w = os.pipe()
    child = mp.get_context("fork").Process(target=crashing_owner, args=(tmp_path, instance, names_w))
    child.start()
    try:
        with os.fdopen(names_r, "rb") as pipe:
            names = json.loads(pipe.readline())
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(JOIN_SECONDS)
        os.close(names_w)
    assert child.exitcode == -signal.SIGKILL
    assert all(segment_path(n).exists() for n in names[:2])
    assert all(doorbell_path(n).exists() for n in names[2:])

    with Owner(tmp_path, instance) as owner:
        assert sorted(owner.swept) == sorted(names)
        assert not any(segment_path(n).exists() for n in names[:2])
        assert not any(doorbell_path(n).exists() for n in names[2:])
        assert owner.manifest.names() == {"segments": [], "doorbells": []}


def test_sweep_skips_names_already_gone_and_refuses_foreign_names(tmp_path, instance):
    manifest = Manifest(tmp_path)
    live = Segment.create(make_name(instance, "live"), 64)
    live.close()
    manifest.add("segment", live.name)
    manifest.add("doorbell", make_name(instance, "never_created"))
    assert manifest.sweep() == [live.name]
    assert not segment_path(live.name).exists()

    with pytest.raises(ValueError):
        manifest.add("queue", make_name(instance, "x"))
    manifest.path.write_text(json.dumps({"owner_pid": 1, "segments": ["/not-ours"], "doorbells": []}))
    with pytest.raises(ValueError, match="not-ours"):
        manifest.sweep()


def test_sweep_false_leaves_leftovers(tmp_path, instance):
    leftover = Segment.create(make_name(instance, "left"), 64)
    leftover.close()
    Manifest(tmp_path).add("segment", leftover.name)
    with Owner(tmp_path, instance, sweep=False) as owner:
        assert owner.swept == []
        assert segment_path(leftover.name).exists()
    assert Manifest(tmp_path).sweep() == [leftover.name]
