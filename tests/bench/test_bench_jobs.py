"""A small run of `shmbroker bench jobs` (so the benchmark cannot rot): its checks hold at any size."""

from __future__ import annotations

import json

from shmbroker.cli import main


def test_bench_jobs_small_run(capsys):
    assert main(["bench", "jobs", "--json", "--items", "3000", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["items"] == 3000
    p = out["progress"]
    assert len(p["tty_seconds"]) == len(p["pipe_seconds"]) == 1 and p["slowdown"] > 0 and p["submit_slowdown"] > 0
    c = out["cancel"]
    assert c["other_exact"] and c["victim_each_once"] and c["victim_accounted"]
    assert c["victim_status"] == ("completed" if c["completed_before_cancel"] else "cancelled")
    r = out["resume"]
    assert r["each_custom_id_once"] and r["output_lines"] == 3000 and r["resume_exit"] == 0
    assert (r["status"], r["completed"]) == ("completed", 3000)
    h = out["chat"]
    assert h["lines"] == 3000 and len(h["chat_seconds"]) == len(h["ids_seconds"]) == 1
    assert h["client_lines_per_s"] > 0 and h["slowdown"] > 0 and h["tokens"] > 3000


def test_the_chat_twin_holds_the_ids_submit_renders(tmp_path):
    """The token-id file of bench jobs' chat part holds, line for line, what submit makes of the chat file."""
    from shmbroker.bench.jobs_chat import make_files, make_tokenizer
    from shmbroker.commands.reading import read_prompts
    from shmbroker.jobs.text import Tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    make_files(tmp_path / "chat.jsonl", tmp_path / "ids.jsonl", tok, 50, 0)
    chat = list(read_prompts(str(tmp_path / "chat.jsonl"), None, Tokenizer(tok)))
    ids = list(read_prompts(str(tmp_path / "ids.jsonl"), None))
    assert len(chat) == len(ids) == 50
    for a, b in zip(chat, ids):
        assert a.tokens.tolist() == b.tokens.tolist() and a.max_new_tokens == b.max_new_tokens
        assert int((a.tokens == 0).sum()) == 0  # no word fell to <unk>
