"""The job mechanisms without a broker: status from the job files, the results process's tally, the
cancel list, the OpenAI request parser, the progress line, the scheduler's cancel on its index."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from shmbroker.request.options import RequestOptions

from shmbroker.client.seen import SeenSet
from shmbroker.jobs import cancels, store
from shmbroker.jobs.openai_batch import parse_request
from shmbroker.jobs.progress import Progress
from shmbroker.jobs.store import JobMeta, status_of
from shmbroker.jobs.tally import JobTallies, JobTally
from shmbroker.ring.items import SEQ_BITS, Status


def meta(**kw) -> JobMeta:
    base = {"name": "j", "input": "/x", "digest": "sha256:0", "lines": 10, "phase": "in_progress"}
    return JobMeta(**{**base, **kw})


@pytest.mark.parametrize("kw, results, cancelled, alive, want", [
    ({"phase": "validating"}, 0, None, True, "validating"),
    ({"phase": "validating"}, 0, None, False, "failed"),  # its submitter died before it began
    ({"phase": "failed"}, 0, None, False, "failed"),
    ({"submitted": 5}, 3, None, True, "in_progress"),
    ({"submit_done": True, "refused": 10}, 0, None, False, "failed"),  # no line was a request
    ({"submitted": 10, "submit_done": True}, 9, None, False, "in_progress"),
    ({"submitted": 10, "submit_done": True}, 10, None, True, "finalizing"),  # the waiting submitter writes
    ({"submitted": 10, "submit_done": True}, 10, None, False, "completed"),
    ({"submitted": 10, "submit_done": True, "phase": "completed"}, 10, 1.0, False, "completed"),  # cancel came late
    ({"submitted": 4}, 4, 1.0, True, "cancelling"),  # the submitter stops at its next chunk
    ({"submitted": 4, "submit_done": True}, 3, 1.0, False, "cancelling"),
    ({"submitted": 4, "submit_done": True}, 4, 1.0, False, "cancelled"),
])
def test_status_from_the_job_files(kw, results, cancelled, alive, want):
    assert status_of(meta(**kw), results, cancelled, alive) == want


def test_view_counts_failed_by_status_and_unsubmitted_lines_of_a_cancelled_job(tmp_path):
    m = meta(submitted=6, refused=1, submit_done=True)
    store.write_meta(tmp_path, m)
    (store.job_dir(tmp_path, "j") / "counts.json").write_text(json.dumps({"counts": {"ok": 3, "too_long": 1, "cancelled": 2}}))
    v = store.view(tmp_path, "j")
    assert (v["status"], v["completed"], v["failed"], v["cancelled"]) == ("completed", 3, 2, 2)
    assert v["failed_by_status"] == {"too_long": 1, "invalid_request": 1}
    store.write_cancel(tmp_path, "j")
    v = store.view(tmp_path, "j")
    # 10 lines: 3 ok, 2 failed (1 refused), 2 cancelled by the broker, 3 never submitted
    assert (v["status"], v["cancelled"]) == ("cancelled", 5)
    assert v["completed"] + v["failed"] + v["cancelled"] == v["total"]
    assert os.stat(store.job_dir(tmp_path, "j")).st_mode & 0o777 == 0o700
    assert os.stat(store.job_dir(tmp_path, "j") / "job.json").st_mode & 0o777 == 0o600
    summary = store.JobsWatch(tmp_path).summary()
    assert summary["live"] == [] and summary["by_status"]["cancelled"] == 1


def test_job_names():
    assert store.check_name("batch-2026.12_a") == "batch-2026.12_a"
    for bad in ("", "../x", "-a", "a b", "x" * 64):
        with pytest.raises(store.JobError):
            store.check_name(bad)


def test_seen_set_state_round_trips():
    s = SeenSet()
    seqs = np.r_[np.arange(0, SeenSet.CHUNK + 5), [3 * SeenSet.CHUNK + 7]]
    s.add(seqs)
    t = SeenSet.from_state(json.loads(json.dumps(s.state())))
    assert t.contains(seqs).all()
    assert not t.contains(np.array([SeenSet.CHUNK + 5, 3 * SeenSet.CHUNK + 8])).any()
    assert not t.add(seqs).any()


def test_tally_counts_each_item_once_and_reads_back(tmp_path):
    store.write_meta(tmp_path, meta(name="a"))
    names = {7: "a", 8: "not-a-job"}
    tallies = JobTallies(tmp_path, names.get)
    ids = (np.uint64(7) << np.uint64(SEQ_BITS)) | np.arange(6, dtype=np.uint64)
    other = (np.uint64(8) << np.uint64(SEQ_BITS)) | np.arange(3, dtype=np.uint64)
    status = np.array([Status.OK, Status.OK, Status.TOO_LONG, Status.OK, Status.CANCELLED, Status.OK], np.uint32)
    data, pos = result_headers([5, 6, 0, 7, 0, 8, 1, 1, 1])  # generated tokens of each record
    tallies.count(7, None, ids, status, data, pos[:6])
    tallies.count(8, None, other, np.zeros(3, np.uint32), data, pos[6:])
    tallies.count(7, None, ids[:3], status[:3], data, pos[:3])  # delivered again (an item run twice): not counted again
    tallies.save()
    tally = JobTally(tmp_path, "a")
    assert tally.counts == {"ok": 4, "too_long": 1, "cancelled": 1} and tally.generated_tokens == 26
    assert not (store.job_dir(tmp_path, "not-a-job")).exists()
    again = JobTallies(tmp_path, names.get)  # a restarted results process
    again.count(7, np.ones(6, bool), ids, status, data, pos[:6])
    again.save()
    assert JobTally(tmp_path, "a").counts == {"ok": 4, "too_long": 1, "cancelled": 1}
    assert store.view(tmp_path, "a")["generated_tokens"] == 26


def result_headers(num_tokens: list[int]):
    """Result record headers (ring/wire.py's table) holding only `num_tokens`, and their positions."""
    from shmbroker.ring.wire import RES_HEADER_BYTES

    data = np.zeros(len(num_tokens) * RES_HEADER_BYTES, np.uint8)
    pos = np.arange(len(num_tokens), dtype=np.int64) * RES_HEADER_BYTES
    for p, n in zip(pos, num_tokens):
        data[p : p + RES_HEADER_BYTES].view(np.uint32)[8] = n
    return data, pos


def test_cancel_list_is_read_when_it_changes(tmp_path):
    watch = cancels.CancelWatch(tmp_path)
    assert watch.poll() is None
    cancels.add(tmp_path, "a", [3, 4])
    assert watch.poll() == {3, 4}
    assert watch.poll() is None
    cancels.add(tmp_path, "b", [9])
    cancels.add(tmp_path, "a", [5])
    assert watch.poll() == {5, 9}
    assert cancels.CancelWatch(tmp_path).poll() == {3, 4, 5, 9}  # a restarted scheduler


@pytest.mark.parametrize("row, message", [
    ({"custom_id": "", "url": "/v1/completions", "body": {"prompt": [1]}}, "custom_id"),
    ({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": [1]}}, "POST"),
    ({"custom_id": "a", "url": "/v1/moderations", "body": {"prompt": [1]}}, "/v1/completions"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1], "temperature": 9}}, "'temperature'"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1], "tools": []}}, "tools"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1], "response_format": {}}}, "response_format"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1], "frobnicate": 1}}, "frobnicate"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1], "logprobs": 9}}, "logprobs"),
    ({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
     "--tokenizer"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": []}}, "non-empty"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [-1]}}, "0..4294967295"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}, "--tokenizer"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1], "max_tokens": 0}}, "max_tokens"),
    ({"custom_id": "a", "url": "/v1/completions", "body": [1]}, "body"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1]}, "extra": 1}, "unknown"),
])
def test_a_bad_request_line_says_what_is_wrong(row, message):
    with pytest.raises(ValueError, match=message):
        parse_request(row, 3)


def test_a_request_line_with_options_carries_them():
    p = parse_request({"custom_id": "r", "url": "/v1/completions",
                       "body": {"prompt": [5, 6], "temperature": 0.5, "seed": 3, "n": 2, "stop": "x", "logprobs": 2,
                                "max_tokens": 9}}, 4)
    assert (p.max_new_tokens, p.endpoint) == (9, "/v1/completions")
    assert p.options == RequestOptions(temperature=0.5, seed=3, n=2, stop=("x",), logprobs=True, top_logprobs=2)
    assert parse_request({"custom_id": "r", "url": "/v1/completions", "body": {"prompt": [5]}}, 4).options is None


def test_a_request_line_as_the_api_writes_it():
    p = parse_request({"custom_id": "r", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": [[5, 6, 7]]}}, 4)
    assert (p.line, p.id, p.tokens.tolist(), p.max_new_tokens, p.model) == (4, "r", [5, 6, 7], 16, "m")


def test_plain_progress_lines_are_spaced():
    out = io.StringIO()
    with Progress("job x", 100, stream=out, tty=False, plain_seconds=3600) as p:
        for i in range(100):
            p.update(submitted=i + 1, results=i, ok=i)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1  # only the last figures: the interval never came
    assert "job x: 100/100 submitted, 99 results (ok 99, failed 0)" in lines[0]


def test_scheduler_cancel_takes_a_jobs_items_out_of_the_index(tmp_path):
    """Items of a cancelled producer leave the index (and those still to come are refused at admission),
    answered cancelled as failed rows; the other producer's items stay in the index."""
    from shmbroker.config import settings
    from shmbroker.ring.wire import LOC_DTYPE, Announcement
    from shmbroker.sched.scheduler import Scheduler

    cfg = settings.load(None, data_dir=str(tmp_path))
    sched = Scheduler(cfg, ["packed"] * len(cfg.consumers), [], [None] * len(cfg.consumers), None)

    def items(producer: int, n: int, first: int = 0):
        locs = np.zeros(n, LOC_DTYPE)
        locs["item_id"] = (np.uint64(producer) << np.uint64(SEQ_BITS)) | np.arange(first, first + n, dtype=np.uint64)
        locs["seq"] = np.arange(n)
        locs["num_tokens"] = 64
        locs["max_new_tokens"] = 4
        locs["prefix_key"] = np.arange(n) % 5 + 1
        return Announcement(locs, np.zeros(n + 1, np.int64), np.zeros(0, np.uint64))

    sched.add(items(1, 40))
    sched.add(items(2, 30))
    assert len(sched.packer) == 70
    assert sched.cancel({1}) == 40
    left = sched.packer.index.live()[1].astype(np.int64)
    assert len(sched.packer) == 30 and left.size == 30
    assert set((sched.slots["item_id"][left] >> np.uint64(SEQ_BITS)).tolist()) == {2}
    sched.add(items(1, 5, first=40))  # still to come: refused at admission
    assert len(sched.packer) == 30
    failed = np.concatenate(sched.failed.parts)
    assert failed.size == 45
    assert set((failed["item_id"] >> np.uint64(SEQ_BITS)).tolist()) == {1}
    assert (failed["aux"] == Status.CANCELLED).all()
    sched.close()


def test_a_new_jobs_directory_is_taken_once(tmp_path):
    store.create(tmp_path, meta(name="x"))
    with pytest.raises(store.JobError, match="exists"):
        store.create(tmp_path, meta(name="x"))
    os.mkdir(store.job_dir(tmp_path, "y"))  # a crash between the directory and its job.json
    store.create(tmp_path, meta(name="y"))
    assert store.names(tmp_path) == ["x", "y"]


def test_a_job_submitted_with_no_broker_is_failed_and_says_why(tmp_path, capsys):
    from shmbroker.cli import main

    src = tmp_path / "a.jsonl"
    src.write_text('{"tokens": [1, 2], "max_new_tokens": 2}\n')
    assert main(["submit", str(src), "--data-dir", str(tmp_path / "data"), "--job", "lonely"]) == 1
    v = store.view(tmp_path / "data", "lonely")
    assert (v["status"], v["total"], v["submitted"]) == ("failed", 1, 0)
    assert "no broker is running" in v["error"]
    assert main(["job", "nothing", "--data-dir", str(tmp_path / "data")]) == 1
    assert "no job 'nothing'" in capsys.readouterr().err


def test_resume_counts_an_item_acked_while_it_reads(tmp_path, monkeypatch):
    """A results-process checkpoint (counts saved, then acks) that lands while a resumed submitter
    reads what its job has: an item done in between is found in one of the two, never in neither."""
    from types import SimpleNamespace

    from shmbroker.commands.common import IDS_DIR
    from shmbroker.commands.jobrun import JobRun

    store.write_meta(tmp_path, meta(name="j", submitted=3))
    old = (np.uint64(4) << np.uint64(SEQ_BITS)) | np.arange(3, dtype=np.uint64)  # the last lifetime's producer
    (tmp_path / IDS_DIR).mkdir()
    (tmp_path / IDS_DIR / "j.jsonl").write_text(
        "".join(json.dumps({"item_id": int(i), "id": f"c{k}", "line": k + 1, "n": 4}) + "\n" for k, i in enumerate(old)))

    def checkpoint_then_backlog():
        # item 0 was counted before; item 1 completes now: counted on disk, then acked (gone from the
        # backlog); item 2 is still pending
        tallies = JobTallies(tmp_path, {4: "j"}.get)
        data, pos = result_headers([3, 3])
        tallies.count(4, None, old[:2], np.array([Status.OK, Status.OK], np.uint32), data, pos)
        tallies.save()
        return old[2:]

    monkeypatch.setattr(JobRun, "_backlog_ids", lambda self: checkpoint_then_backlog())
    run = JobRun(str(tmp_path), store.read_meta(tmp_path, "j"), True)
    run.attach(SimpleNamespace(producer_id=9, next_item_id=9 << SEQ_BITS))  # this lifetime's producer
    assert run.done_lines == {1, 2, 3}  # every line was submitted: none goes again


def test_a_line_of_several_items_counts_as_submitted_only_whole():
    """`--resume` submits again a line only some of whose items were pushed (an embeddings line's
    inputs); a line of one item is whole with it."""
    from shmbroker.commands.jobrun import whole_lines

    entries = [{"line": 1}, {"line": 2, "parts": 3, "part": 0}, {"line": 2, "parts": 3, "part": 2},
               {"line": 3, "parts": 2, "part": 1}, {"line": 3, "parts": 2, "part": 0}, {"line": 3, "parts": 2, "part": 0}]
    assert whole_lines(entries) == {1, 3}
