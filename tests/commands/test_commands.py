"""`shmbroker submit`, `results` and `status` against a real broker (one for the module)."""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import serve

from shmbroker.cli import main
from shmbroker.commands.reading import read_trace as _read_trace
from shmbroker.jobs.prompts import LineError, Prompt

REAL_TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("broker"), "cmd") as b:
        yield b


def _name() -> str:
    return "t-" + secrets.token_hex(4)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_good_lines_come_back_once_each_and_bad_lines_are_named(broker, tmp_path, capsys):
    good = [
        {"tokens": [1, 2, 3], "max_new_tokens": 4, "id": "a"},
        {"tokens": list(range(100, 140)), "max_new_tokens": 2, "prefix_len": 16, "id": 7},
        {"tokens": [5, 6], "max_new_tokens": 3},  # no id
        {"tokens": [4294967295, 0], "max_new_tokens": 1, "id": "edge"},
    ]
    rows = [
        good[0],
        '{"tokens": [1, 2,',                                        # 2: malformed JSON
        {"tokens": "1 2 3", "max_new_tokens": 4},                   # 3: wrong type
        {"tokens": [], "max_new_tokens": 4, "id": "empty"},         # 4: empty
        {"tokens": [1, 4294967296], "max_new_tokens": 4},           # 5: above uint32
        good[1],
        "",                                                         # blank: skipped, not an error
        {"tokens": [1], "max_new_tokens": "8"},                     # 8: wrong type
        {"tokens": [7] * 10000, "max_new_tokens": 1, "id": "long"},  # 9: too long for every consumer
        {"tokens": [9] * 300_000, "max_new_tokens": 1, "id": "huge"},  # 10: more than the ingest ring takes
        good[2],
        {"tokens": [1], "max_new_tokens": 1, "colour": "red"},      # 12: unknown key
        good[3],
    ]
    src = _write(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "results.jsonl"
    name = _name()
    rc = main(["submit", str(src), "--name", name, "--data-dir", broker.data_dir, "--wait", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1  # some lines refused
    for line, words in [(2, "not JSON"), (3, "non-empty list"), (4, "non-empty list"), (5, "0..4294967295"),
                        (8, "max_new_tokens"), (10, "ingest ring"), (12, "unknown key")]:
        assert f"{src}:{line}: " in err and words in err.split(f"{src}:{line}: ", 1)[1].splitlines()[0], err
    for line in (1, 6, 9, 11, 13):
        assert f"{src}:{line}:" not in err
    assert f"producer {name!r}" in err and "submitted 5 items, refused 7 lines" in err

    got = _rows(out)
    assert len(got) == 5 and len({r["item_id"] for r in got}) == 5
    by_id = {r["id"]: r for r in got}
    assert set(by_id) == {"a", 7, None, "edge", "long"}
    assert by_id["long"]["status"] == "too_long" and by_id["long"]["tokens"] == [] and by_id["long"]["error"]
    for want in good:
        r = by_id[want.get("id")]
        assert r["status"] == "ok" and r["error"] is None
        assert 1 <= len(r["tokens"]) <= want["max_new_tokens"]
    assert set(got[0]) == {"item_id", "id", "status", "tokens", "error"}

    # the sidecar maps item ids to the user's ids, private to the user
    ids_path = Path(broker.data_dir) / "submit-ids" / f"{name}.jsonl"
    assert stat.S_IMODE(ids_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(ids_path.parent.stat().st_mode) == 0o700
    side = _rows(ids_path)
    assert [(s["id"], s["line"]) for s in side] == [("a", 1), (7, 6), ("long", 9), ("edge", 13)]
    assert {s["item_id"] for s in side} == {r["item_id"] for r in got if r["id"] is not None}


def test_all_good_exits_0_and_default_max_new_tokens_fills_in(broker, tmp_path, capsys):
    src = _write(tmp_path / "p.jsonl", [{"tokens": [1, 2, 3], "id": "x"}, {"tokens": [4], "max_new_tokens": 1, "id": "y"}])
    rc = main(["submit", str(src), "--data-dir", broker.data_dir, "--max-new-tokens", "3", "--wait"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert f"submit-{os.getpid()}" in cap.err  # the default name, said so `results` can use it
    got = {r["id"]: r for r in map(json.loads, cap.out.splitlines())}
    assert set(got) == {"x", "y"} and all(r["status"] == "ok" for r in got.values())
    assert 1 <= len(got["x"]["tokens"]) <= 3
    # without the default the line lacking max_new_tokens is refused
    rc = main(["submit", str(src), "--name", _name(), "--data-dir", broker.data_dir])
    assert rc == 1 and f"{src}:1: 'tokens' and 'max_new_tokens' are required" in capsys.readouterr().err


def test_results_after_the_producer_left(broker, tmp_path, capsys):
    rows = [{"tokens": [i, i + 1, i + 2], "max_new_tokens": 2, "id": f"q{i}"} for i in range(50)]
    src = _write(tmp_path / "p.jsonl", rows)
    name = _name()
    assert main(["submit", str(src), "--name", name, "--data-dir", broker.data_dir]) == 0
    capsys.readouterr()
    out = tmp_path / "r.jsonl"
    assert main(["results", "--name", name, "--data-dir", broker.data_dir, "--out", str(out), "--timeout", "1"]) == 0
    assert f"50 results for producer {name!r}" in capsys.readouterr().err
    got = _rows(out)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)
    assert all(r["status"] == "ok" for r in got) and len({r["item_id"] for r in got}) == 50
    # read once: a second call finds nothing new, and appends nothing to the file
    assert main(["results", "--name", name, "--data-dir", broker.data_dir, "--out", str(out), "--timeout", "0.3"]) == 0
    assert "0 results" in capsys.readouterr().err
    assert len(_rows(out)) == 50


def test_results_of_a_partly_read_producer_to_stdout(broker, tmp_path, capsys):
    from shmbroker.client.producer import Producer

    name = _name()
    rows = [{"tokens": [3, i], "max_new_tokens": 1, "id": i} for i in range(10)]
    assert main(["submit", str(_write(tmp_path / "p.jsonl", rows)), "--name", name,
                 "--data-dir", broker.data_dir]) == 0
    with Producer(name, data_dir=broker.data_dir) as p:
        taken = p.take_results(timeout_seconds=5.0)  # what it popped, it returns: nothing is held back
    assert 1 <= len(taken) <= 10
    capsys.readouterr()
    assert main(["results", "--name", name, "--data-dir", broker.data_dir, "--timeout", "1"]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    side = {s["item_id"]: s["id"] for s in _rows(Path(broker.data_dir) / "submit-ids" / f"{name}.jsonl")}
    assert {r["id"] for r in got} == set(range(10)) - {side[int(i)] for i in taken.item_ids}
    assert len(got) == 10 - len(taken)


def test_results_left_in_a_closed_producers_queue_are_not_lost(broker, tmp_path, capsys):
    from shmbroker.client.producer import Producer

    name = _name()
    rows = [{"tokens": [4, i], "max_new_tokens": 1} for i in range(10)]
    assert main(["submit", str(_write(tmp_path / "p.jsonl", rows)), "--name", name,
                 "--data-dir", broker.data_dir]) == 0
    time.sleep(1.0)  # all ten results are on the producer's ring by now
    with Producer(name, data_dir=broker.data_dir) as p:
        first = next(p.results(timeout_seconds=5.0))  # read one, leave the rest for later
    capsys.readouterr()
    assert main(["results", "--name", name, "--data-dir", broker.data_dir, "--timeout", "1"]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert first.item_id not in {r["item_id"] for r in got}
    assert len(got) == 9


def _mooncake(path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1024, "output_length": 3, "hash_ids": [1, 3]},
        {"timestamp": 20, "input_length": 100, "hash_ids": [4]},  # no output_length: --max-new-tokens
        {"timestamp": 30, "input_length": 2000, "output_length": 1, "hash_ids": [1]},  # 1 block for 2000: bad
        "not json",
        {"timestamp": 40, "input_length": 513, "output_length": 2, "hash_ids": [1, 5]},
    ]
    return _write(path, rows)


def test_trace_reader_synthesises_what_bench_trace_does(tmp_path):
    from shmbroker.workloads import trace

    src = _mooncake(tmp_path / "trace.jsonl")
    out = sorted(_read_trace(str(src), 4), key=lambda o: o.line)  # errors come before buffered lines
    assert [type(o) for o in out] == [Prompt, Prompt, Prompt, LineError, LineError, Prompt]
    assert [o.line for o in out] == [1, 2, 3, 4, 5, 6]
    assert [o.max_new_tokens for o in out if isinstance(o, Prompt)] == [5, 3, 4, 2]
    good = tmp_path / "good.jsonl"
    good.write_text("".join(line + "\n" for i, line in enumerate(src.read_text().splitlines()) if i not in (3, 4)))
    w = trace.load(good)
    prompts = [o for o in out if isinstance(o, Prompt)]
    for i, p in enumerate(prompts):
        assert np.array_equal(p.tokens, w.tokens[w.offsets[i] : w.offsets[i + 1]])


def test_submit_trace(broker, tmp_path, capsys):
    src = _mooncake(tmp_path / "trace.jsonl")
    name = _name()
    rc = main(["submit", str(src), "--trace", "--name", name, "--data-dir", broker.data_dir, "--wait",
               "--max-new-tokens", "4"])
    cap = capsys.readouterr()
    assert rc == 1
    assert f"{src}:4: input_length 2000 does not match 1 blocks" in cap.err
    assert f"{src}:5: not a Mooncake trace record" in cap.err
    got = [json.loads(line) for line in cap.out.splitlines()]
    assert len(got) == 4 and all(r["status"] == "ok" for r in got)
    got.sort(key=lambda r: r["item_id"])  # item ids follow the file's order
    for r, max_new in zip(got, [5, 3, 4, 2]):
        assert 1 <= len(r["tokens"]) <= max_new


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the Mooncake trace is not here")
def test_submit_real_trace_head(broker, tmp_path, capsys):
    head = tmp_path / "head.jsonl"
    with open(REAL_TRACE) as fh:
        lines = [next(fh) for _ in range(40)]
    head.write_text("".join(lines))
    name = _name()
    rc = main(["submit", str(head), "--trace", "--name", name, "--data-dir", broker.data_dir, "--wait"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    got = [json.loads(line) for line in cap.out.splitlines()]
    lengths = [json.loads(line)["input_length"] for line in lines]
    assert len(got) == 40 and len({r["item_id"] for r in got}) == 40
    # the small test config takes up to 8192 tokens: longer items are failed back as too_long
    assert sum(r["status"] == "too_long" for r in got) == sum(n > 8192 for n in lengths)
    assert sum(r["status"] == "ok" for r in got) == sum(n <= 8192 for n in lengths)


def test_status_shows_consumers_and_counters(broker, tmp_path, capsys):
    rows = [{"tokens": list(range(i, i + 64)), "max_new_tokens": 1} for i in range(20)]
    assert main(["submit", str(_write(tmp_path / "p.jsonl", rows)), "--name", _name(),
                 "--data-dir", broker.data_dir, "--wait"]) == 0
    capsys.readouterr()
    assert main(["status", "--data-dir", broker.data_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("pid", "processes", "consumers", "ingest", "scheduler", "results", "backlog", "rates", "rings"):
        assert key in report
    assert report["pid"] == broker.proc.pid
    roles = {p["role"]: p for p in report["processes"]}
    assert set(roles) == {"ingest-0", "sched", "results", "gpu-big", "gpu-small", "metrics"}
    assert all(p["alive"] and p["pid"] > 0 and p["restarts"] == 0 for p in roles.values())
    assert all(0 <= p["heartbeat_age_seconds"] < 5 for p in roles.values())
    assert set(report["consumers"]) == {"big", "small"}
    served = sum(c["items"] for c in report["consumers"].values())
    assert served >= 20 and sum(c["ok"] for c in report["consumers"].values()) >= 20
    assert all(c["guard_violations"] == 0 for c in report["consumers"].values())
    assert report["ingest"]["items"] >= 20 and report["ingest"]["tokens"] >= 20 * 64
    assert report["results"]["results"] >= 20 and report["scheduler"]["batches"] >= 1
    assert report["backlog"]["segments"] >= 0 and report["backlog"]["disk_bytes"] > 0
    assert set(report["rates"]["consumers"]) == {"big", "small"}
    assert report["rates"]["ingest"]["items_per_second"] >= 0

    assert main(["status", "--data-dir", broker.data_dir]) == 0
    screen = capsys.readouterr().out
    for words in ("processes", "consumers", "gpu-big", "gpu-small", "big", "small", "ingest", "scheduler",
                  "backlog", "tokens/s"):
        assert words in screen


def test_no_broker(tmp_path, capsys):
    data = str(tmp_path / "nothing")
    assert main(["status", "--data-dir", data]) == 1
    assert f"no broker is running on data directory {data!r}" in capsys.readouterr().err
    assert main(["status", "--data-dir", data, "--json"]) == 1
    capsys.readouterr()
    src = _write(tmp_path / "p.jsonl", [{"tokens": [1], "max_new_tokens": 1}])
    assert main(["submit", str(src), "--data-dir", data]) == 1
    assert "no broker is running" in capsys.readouterr().err
    assert main(["results", "--name", "x", "--data-dir", data]) == 1
    assert "no broker is running" in capsys.readouterr().err


def test_bad_config_file_or_option(tmp_path, capsys):
    src = _write(tmp_path / "p.jsonl", [{"tokens": [1], "max_new_tokens": 1}])
    missing = str(tmp_path / "none.toml")
    for argv in (["submit", str(src)], ["results", "--name", "x"], ["status"]):
        assert main(argv + ["--config", missing]) == 2
        assert "no such configuration file" in capsys.readouterr().err
    assert main(["submit", str(tmp_path / "absent.jsonl"), "--data-dir", str(tmp_path)]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    assert main(["submit", str(src), "--data-dir", str(tmp_path), "--max-new-tokens", "0"]) == 2


def test_cli_subprocess_plain_output(broker, tmp_path):
    """The installed way: no progress bar on a pipe, the summary on stderr, results on stdout."""
    src = _write(tmp_path / "p.jsonl", [{"tokens": [1, 2], "max_new_tokens": 1, "id": "only"}])
    proc = subprocess.run([sys.executable, "-m", "shmbroker.cli", "submit", str(src), "--data-dir", broker.data_dir,
                           "--name", _name(), "--wait"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "submitted 1 items, refused 0 lines" in proc.stderr and "\x1b[" not in proc.stderr
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert row["id"] == "only" and row["status"] == "ok"


def test_wait_under_a_reused_name_also_hands_back_the_earlier_runs_results(broker, tmp_path, capsys):
    name = _name()
    first = [{"tokens": [8, i], "max_new_tokens": 1, "id": f"first-{i}"} for i in range(5)]
    second = [{"tokens": [9, i], "max_new_tokens": 1, "id": f"second-{i}"} for i in range(5)]
    dd = ["--data-dir", broker.data_dir, "--name", name]
    assert main(["submit", str(_write(tmp_path / "a.jsonl", first))] + dd) == 0
    out = tmp_path / "out.jsonl"
    assert main(["submit", str(_write(tmp_path / "b.jsonl", second)), "--wait", "--out", str(out)] + dd) == 0
    assert main(["results", "--out", str(out), "--timeout", "1"] + dd) == 0  # appends what is left
    capsys.readouterr()
    got = _rows(out)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in first + second)
    assert len({r["item_id"] for r in got}) == 10


def test_unwritable_out_file(broker, tmp_path, capsys):
    src = _write(tmp_path / "p.jsonl", [{"tokens": [1], "max_new_tokens": 1}])
    bad = str(tmp_path / "no" / "such" / "dir.jsonl")
    assert main(["submit", str(src), "--data-dir", broker.data_dir, "--name", _name(), "--wait", "--out", bad]) == 2
    assert bad in capsys.readouterr().err
    assert main(["results", "--name", _name(), "--data-dir", broker.data_dir, "--out", bad]) == 2
    assert bad in capsys.readouterr().err
