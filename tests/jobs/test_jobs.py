"""Batch jobs against a real broker: OpenAI Batch files in and out, job status and counts, cancel,
resume after a SIGKILL, state across a broker restart, text prompts, and the job views."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.brokerproc import serve
from support.harness import wait_for

from shmbroker.cli import main
from shmbroker.jobs import store

# One fast consumer (the round-trip tests) ...
FAST_CONFIG = """
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 65536

[[consumers]]
name = "fast"
max_batch_size = 64
max_batch_tokens = 65536
max_input_len = 1024
engine_settings = { mode = "packed", cache_tokens = 262144, pace_seconds = 0.0 }
"""
# ... and a slow one, so that a job has items queued, dispatched and finished at once (cancel, restart)
SLOW_CONFIG = FAST_CONFIG.replace('name = "fast"', 'name = "slow"').replace("max_batch_size = 64", "max_batch_size = 4") \
    .replace("pace_seconds = 0.0", "pace_seconds = 2.0")


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("fast"), "jf", FAST_CONFIG) as b:
        yield b


def _name() -> str:
    return "j-" + secrets.token_hex(4)


def request_line(i: int, prompt, max_tokens: int = 4, model: str = "m") -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens}}


def openai_file(path: Path, n: int, extra: list[str] = (), prompt_len: int = 24) -> Path:
    lines = [json.dumps(request_line(i, [(i * 7 + k) % 5000 + 1 for k in range(prompt_len + i % 9)])) for i in range(n)]
    path.write_text("\n".join(lines + list(extra)) + "\n")
    return path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def cli(*argv) -> int:
    return main([str(a) for a in argv])


def shmbroker(*argv, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shmbroker.cli", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


# -- the OpenAI Batch format --------------------------------------------------------------------


def test_openai_file_round_trips_through_the_openai_types(fast, tmp_path, capsys):
    from openai.types import BatchError, BatchRequestCounts, Completion

    name = _name()
    bad = ["not json at all", json.dumps({"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
                                          "body": {"model": "m", "messages": []}}),
           json.dumps(request_line(900, "some text"))]  # a text prompt without a tokenizer
    too_long = json.dumps(request_line(901, list(range(1, 2000))))  # longer than max_input_len 1024
    src = openai_file(tmp_path / "batch.jsonl", 300, bad + [too_long])
    out = tmp_path / "out.jsonl"
    code = cli("submit", src, "--data-dir", fast.data_dir, "--job", name, "--model", "default", "--wait",
               "--out", out, "--out-format", "openai")
    err = capsys.readouterr().err
    assert code == 1, err  # three lines refused
    for line in (301, 302, 303):
        assert f"batch.jsonl:{line}:" in err
    assert "a text prompt needs --tokenizer" in err and "a chat request needs --tokenizer" in err
    good = rows(out)
    errors = rows(tmp_path / "out.errors.jsonl")
    assert sorted(r["custom_id"] for r in good) == sorted(f"req-{i}" for i in range(300))
    for r in good:
        body = Completion.model_validate(r["response"]["body"])
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert body.object == "text_completion" and len(body.choices) == 1
        assert body.usage.completion_tokens == len(r["response"]["body"]["choices"][0]["token_ids"]) == 4
        assert body.choices[0].finish_reason == "length"
        i = int(r["custom_id"].split("-")[1])
        assert body.usage.prompt_tokens == 24 + i % 9
    assert len(errors) == 4
    by_line = {e["error"]["line"]: e for e in errors if e["response"] is None}
    assert sorted(by_line) == [301, 302, 303]
    for e in by_line.values():
        BatchError.model_validate(e["error"])
    assert by_line[302]["custom_id"] == "chat-1" and by_line[303]["custom_id"] == "req-900"
    failed = [e for e in errors if e["response"] is not None]
    assert [e["custom_id"] for e in failed] == ["req-901"]
    assert failed[0]["response"]["status_code"] == 400 and failed[0]["response"]["body"]["error"]["code"] == "too_long"
    v = wait_for(lambda: (v := store.view(fast.data_dir, name))["status"] == "completed" and v, 10, "completed")
    assert (v["total"], v["completed"], v["failed"], v["cancelled"]) == (304, 300, 4, 0)
    assert v["failed_by_status"] == {"too_long": 1, "invalid_request": 3}
    BatchRequestCounts.model_validate(v)
    assert cli("jobs", "--data-dir", fast.data_dir, "--json") == 0
    listed = {j["name"]: j for j in json.loads(capsys.readouterr().out)}
    assert {k: listed[name][k] for k in ("status", "total", "completed", "failed", "cancelled")} == \
        {"status": "completed", "total": 304, "completed": 300, "failed": 4, "cancelled": 0}


def test_results_of_a_job_in_the_openai_format_later(fast, tmp_path, capsys):
    """A job submitted without --wait: `results --name JOB --out-format openai` writes its output and
    error files, keyed by custom_id; a second run on them adds nothing."""
    from openai.types import Completion

    name = _name()
    src = openai_file(tmp_path / "a.jsonl", 40, [json.dumps(request_line(77, list(range(1, 1500))))])
    assert cli("submit", src, "--data-dir", fast.data_dir, "--job", name, "--model", "default") == 0
    wait_for(lambda: store.view(fast.data_dir, name)["status"] == "completed", 30, "completed")
    out = tmp_path / "out.jsonl"
    assert cli("results", "--name", name, "--data-dir", fast.data_dir, "--out", out, "--out-format", "openai") == 0
    got, errors = rows(out), rows(tmp_path / "out.errors.jsonl")
    assert sorted(r["custom_id"] for r in got) == sorted(f"req-{i}" for i in range(40))
    for r in got:
        Completion.model_validate(r["response"]["body"])
    assert [e["custom_id"] for e in errors] == ["req-77"]
    assert cli("results", "--name", name, "--data-dir", fast.data_dir, "--out", out, "--out-format", "openai",
               "--timeout", "0.2") == 0
    assert len(rows(out)) == 40
    assert cli("results", "--name", "not-a-job", "--data-dir", fast.data_dir, "--out-format", "openai") == 2
    assert "no job" in capsys.readouterr().err


def test_a_model_no_consumer_serves_is_named_at_submit(fast, tmp_path, capsys):
    src = openai_file(tmp_path / "a.jsonl", 3)
    out = tmp_path / "out.jsonl"
    assert cli("submit", src, "--data-dir", fast.data_dir, "--job", _name(), "--wait", "--out", out,
               "--out-format", "openai") == 0
    err = capsys.readouterr().err
    assert "no consumer of this broker serves model 'm' (3 items" in err and "--model default" in err
    got = rows(tmp_path / "out.errors.jsonl")
    assert [r["response"]["body"]["error"]["code"] for r in got] == ["invalid"] * 3


def test_native_format_job_and_the_same_file_again(fast, tmp_path, capsys):
    name = _name()
    src = tmp_path / "native.jsonl"
    src.write_text("".join(json.dumps({"tokens": [i + 1, i + 2, i + 3], "max_new_tokens": 3, "id": f"n{i}"}) + "\n"
                           for i in range(50)) + '{"tokens": []}\n')
    out = tmp_path / "out.jsonl"
    assert cli("submit", src, "--data-dir", fast.data_dir, "--job", name, "--wait", "--out", out) == 1
    got = rows(out)
    assert sorted(r["id"] for r in got if r["status"] == "ok") == sorted(f"n{i}" for i in range(50))
    assert [r for r in got if r["status"] != "ok"] == [
        {"item_id": None, "id": None, "line": 51, "status": "invalid", "tokens": [],
         "error": "'tokens' and 'max_new_tokens' are required"}]
    capsys.readouterr()
    assert cli("submit", src, "--data-dir", fast.data_dir, "--job", name) == 2
    assert "--resume" in capsys.readouterr().err  # the same job name again is refused
    other = tmp_path / "other.jsonl"
    other.write_text(src.read_text() + '{"tokens": [1], "max_new_tokens": 1}\n')
    assert cli("submit", other, "--data-dir", fast.data_dir, "--job", name, "--resume") == 2
    assert "another input" in capsys.readouterr().err
    assert cli("submit", src, "--data-dir", fast.data_dir, "--job", name, "--resume", "--wait", "--out", out) == 1
    assert len(rows(out)) == 51  # nothing again: every line had its result
    assert cli("job", name, "--data-dir", fast.data_dir, "--json") == 0
    v = json.loads(capsys.readouterr().out)
    assert (v["status"], v["completed"], v["failed"]) == ("completed", 50, 1)


def test_text_prompts_with_a_tokenizer_made_here(fast, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(40)]
    tok.train_from_iterator([" ".join(words)] * 4, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "text.jsonl"
    src.write_text("".join(json.dumps(request_line(i, " ".join(words[i : i + 12]), 3)) + "\n" for i in range(20)))
    out = tmp_path / "out.jsonl"
    assert cli("submit", src, "--data-dir", fast.data_dir, "--job", _name(), "--model", "default", "--tokenizer",
               tmp_path, "--wait", "--out", out, "--out-format", "openai") == 0
    got = rows(out)
    assert len(got) == 20
    for r in got:
        choice = r["response"]["body"]["choices"][0]
        assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
        assert r["response"]["body"]["usage"]["prompt_tokens"] == 12
    assert cli("submit", src, "--data-dir", fast.data_dir, "--tokenizer", tmp_path / "nothing-here") == 2
    assert "no tokenizer.json" in capsys.readouterr().err


# -- cancel, restart, resume (a slow consumer: items queued, dispatched and finished at once) ---------------


def test_cancel_with_items_queued_dispatched_and_finished(tmp_path, capsys):
    with serve(tmp_path, "jc", SLOW_CONFIG) as broker:
        d = broker.data_dir
        victim, other = _name(), _name()
        a = openai_file(tmp_path / "a.jsonl", 400)
        b = openai_file(tmp_path / "b.jsonl", 60)
        assert cli("submit", a, "--data-dir", d, "--job", victim, "--model", "default") == 0
        assert cli("submit", b, "--data-dir", d, "--job", other, "--model", "default") == 0
        wait_for(lambda: store.view(d, victim)["completed"] >= 8, 60, "some of the victim's items finish")
        assert cli("cancel", victim, "--data-dir", d) == 0
        at_cancel = store.view(d, victim)["completed"]
        assert "cancelling" in capsys.readouterr().err
        v = wait_for(lambda: (v := store.view(d, victim))["status"] == "cancelled" and v, 60, "cancelled")
        # finished before the cancel, and those dispatched (in the consumer's ring and engine) finish after it
        assert v["completed"] > at_cancel >= 8 and v["cancelled"] > 200
        assert v["completed"] + v["cancelled"] + v["failed"] == v["total"] == 400
        o = wait_for(lambda: (o := store.view(d, other))["status"] == "completed" and o, 120, "the other job completes")
        assert (o["completed"], o["failed"], o["cancelled"]) == (60, 0, 0)
        out_a, out_b = tmp_path / "ra.jsonl", tmp_path / "rb.jsonl"
        assert cli("results", "--name", victim, "--data-dir", d, "--out", out_a) == 0
        assert cli("results", "--name", other, "--data-dir", d, "--out", out_b) == 0
        ra, rb = rows(out_a), rows(out_b)
        assert len(ra) == 400 and len({r["item_id"] for r in ra}) == 400
        assert sum(r["status"] == "cancelled" for r in ra) == v["cancelled"]
        assert sum(r["status"] == "ok" for r in ra) == v["completed"]
        assert len(rb) == 60 and all(r["status"] == "ok" for r in rb)
        assert cli("status", "--data-dir", d, "--json") == 0
        snap = json.loads(capsys.readouterr().out)
        assert snap["scheduler"]["cancelled"] == v["cancelled"]
        assert snap["jobs"]["by_status"]["cancelled"] == 1
        assert cli("cancel", victim, "--data-dir", d) == 0  # again: already cancelled
        assert cli("cancel", other, "--data-dir", d) == 1  # completed: nothing to cancel


def test_job_state_survives_a_broker_restart_and_resume_after_sigkill(tmp_path, capsys):
    with serve(tmp_path, "jr", SLOW_CONFIG) as broker:
        d = broker.data_dir
        name = _name()
        src = openai_file(tmp_path / "a.jsonl", 120)
        out = tmp_path / "out.jsonl"
        args = ["submit", src, "--data-dir", d, "--job", name, "--model", "default", "--wait", "--out", out,
                "--out-format", "openai"]
        p = shmbroker(*args)
        wait_for(lambda: len(rows(out)) >= 10, 60, "ten results written")
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        before = store.view(d, name)
        assert before["status"] == "in_progress" and before["submitted"] == 120
        broker.stop()
        broker.start()
        after = store.view(d, name)
        assert after["completed"] >= before["completed"] and after["total"] == 120
        assert cli(*args[:-4], "--resume", "--wait", "--out", out, "--out-format", "openai") == 0
        err = capsys.readouterr().err
        assert "120 lines submitted before" in err, err
        got = rows(out)
        assert sorted(r["custom_id"] for r in got) == sorted(f"req-{i}" for i in range(120))
        v = wait_for(lambda: (v := store.view(d, name))["status"] == "completed" and v, 10, "completed")
        assert (v["completed"], v["failed"], v["results"]) == (120, 0, 120)


def test_resume_submits_only_what_was_not_submitted(tmp_path, capsys):
    """A submit SIGKILLed part way through the file: --resume submits the rest, each custom_id once."""
    with serve(tmp_path, "js", FAST_CONFIG.replace("pace_seconds = 0.0", "pace_seconds = 0.05")) as broker:
        d = broker.data_dir
        name = _name()
        src = openai_file(tmp_path / "a.jsonl", 6000, prompt_len=200)
        out = tmp_path / "out.jsonl"
        args = ["submit", src, "--data-dir", d, "--job", name, "--model", "default", "--wait", "--out", out,
                "--out-format", "openai"]
        p = shmbroker(*args)
        wait_for(lambda: store.is_job(d, name) and store.read_meta(d, name).submitted > 0, 60, "some submitted")
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        pushed = store.read_meta(d, name).submitted
        assert cli(*args, "--resume") == 0
        err = capsys.readouterr().err
        assert "lines submitted before" in err
        got = rows(out)
        assert sorted(r["custom_id"] for r in got) == sorted(f"req-{i}" for i in range(6000))
        v = wait_for(lambda: (v := store.view(d, name))["status"] == "completed" and v, 10, "completed")
        assert (v["completed"], v["results"]) == (6000, 6000), (pushed, v)


# -- progress and the views ------------------------------------------------------------------------


def test_progress_without_a_terminal_is_a_plain_line_every_few_seconds(fast, tmp_path):
    src = openai_file(tmp_path / "a.jsonl", 200)
    p = shmbroker("submit", src, "--data-dir", fast.data_dir, "--job", _name(), "--model", "default", "--wait",
                  "--out", tmp_path / "out.jsonl", "--progress-seconds", "0.05")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = [x for x in err.splitlines() if " submitted, " in x and " tokens/s, " in x]
    assert lines and "200/200 submitted, 200 results (ok 200, failed 0)" in lines[-1]
    assert "\x1b[" not in err  # no terminal codes


def test_progress_on_a_terminal_and_job_watch(fast, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    src = openai_file(tmp_path / "a.jsonl", 3000)
    name = _name()
    env = {**os.environ, "COLUMNS": "160", "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "shmbroker.cli", "submit", str(src), "--data-dir", fast.data_dir,
                                           "--job", name, "--model", "default", "--wait", "--out",
                                           str(tmp_path / "out.jsonl")], env=env, encoding="utf-8", timeout=60,
                          dimensions=(40, 160))
    child.expect(r"tokens/s")
    child.expect(r"3,000/3,000 results")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    watch = pexpect.spawn(sys.executable, ["-m", "shmbroker.cli", "job", name, "--watch", "--data-dir", fast.data_dir],
                          env=env, encoding="utf-8", timeout=30, dimensions=(40, 160))
    watch.expect(r"3,000/3,000 results")
    watch.expect(f"job {name} completed")
    watch.expect(pexpect.EOF)
    watch.close()
    assert watch.exitstatus == 0


def test_exporter_and_top_show_live_jobs(tmp_path, capsys):
    import urllib.request

    from shmbroker.observe.top import render
    from shmbroker.observe.watch import BrokerView

    with serve(tmp_path, "jx", SLOW_CONFIG) as broker:
        d = broker.data_dir
        name = _name()
        assert cli("submit", openai_file(tmp_path / "a.jsonl", 100), "--data-dir", d, "--job", name, "--model", "default") == 0
        view = BrokerView.attach(d)
        try:
            snap = view.snapshot()
            assert [j["name"] for j in snap["jobs"]["live"]] == [name]
            from rich.console import Console

            console = Console(record=True, width=160, height=60, file=open(os.devnull, "w"))
            console.print(render(snap, {}))
            assert name in console.export_text()
            port = snap["metrics_addr"].rsplit(":", 1)[1]
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            assert f'shmbroker_job_items{{job="{name}",state="total",status="in_progress"}} 100.0' in text
            assert 'shmbroker_jobs{status="in_progress"} 1.0' in text
        finally:
            view.close()
        assert cli("cancel", name, "--data-dir", d) == 0
        wait_for(lambda: store.view(d, name)["status"] == "cancelled", 60, "cancelled")
        view = BrokerView.attach(d)
        try:
            assert view.snapshot()["jobs"]["live"] == []  # bounded: only the live jobs
        finally:
            view.close()


def test_a_cancel_made_while_the_broker_is_down_is_obeyed_at_its_start(tmp_path, capsys):
    broker = serve(tmp_path, "jd", SLOW_CONFIG)
    with broker as b:
        d = b.data_dir
        name = _name()
        assert cli("submit", openai_file(tmp_path / "a.jsonl", 200), "--data-dir", d, "--job", name, "--model", "default") == 0
        wait_for(lambda: store.view(d, name)["completed"] >= 4, 60, "some finish")
        b.stop()
        down = store.view(d, name)
        assert down["status"] == "in_progress" and down["completed"] < 200
        assert cli("cancel", name, "--data-dir", d) == 0  # files only: no broker needed
        assert store.view(d, name)["status"] == "cancelling"
        b.start()
        v = wait_for(lambda: (v := store.view(d, name))["status"] == "cancelled" and v, 60, "cancelled after the start")
        assert v["completed"] >= down["completed"] and v["completed"] + v["cancelled"] == 200
        assert cli("status", "--data-dir", d, "--json") == 0
        assert json.loads(capsys.readouterr().out)["backlog"]["pending_items"] == 0


def test_cancel_reaches_items_waiting_on_disk_beyond_the_index(tmp_path):
    """A job larger than the packing index: what waits beyond it (sched/waiting/) comes back cancelled
    as it is read back, without running."""
    config = SLOW_CONFIG.replace("index_items = 65536", "index_items = 1024")
    with serve(tmp_path, "jw", config) as broker:
        d = broker.data_dir
        name = _name()
        assert cli("submit", openai_file(tmp_path / "a.jsonl", 3000), "--data-dir", d, "--job", name, "--model", "default") == 0
        wait_for(lambda: store.view(d, name)["completed"] >= 4, 60, "some finish")
        assert cli("cancel", name, "--data-dir", d) == 0
        v = wait_for(lambda: (v := store.view(d, name))["status"] == "cancelled" and v, 60, "cancelled")
        assert v["cancelled"] > 2900 and v["completed"] + v["cancelled"] == 3000
