"""Prompt files for `shmbroker submit`: good lines parsed, each bad line an error of its own."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shmbroker.jobs.prompts import LineError, Prompt, parse_line, read_prompts


def test_a_full_line_and_a_minimal_one():
    p = parse_line(json.dumps({"tokens": [1, 2, 3], "max_new_tokens": 8, "prefix_len": 2, "model": "m", "id": "q"}))
    assert p.tokens.dtype == np.uint32 and p.tokens.tolist() == [1, 2, 3]
    assert (p.max_new_tokens, p.prefix_len, p.model, p.id) == (8, 2, "m", "q")
    q = parse_line('{"tokens": [4294967295], "max_new_tokens": 1}')
    assert q.tokens.tolist() == [4294967295] and q.prefix_len is None and q.model is None and q.id is None


@pytest.mark.parametrize("line, words", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"tokens": [1], "max_new_tokens": 1, "colour": 3}', "unknown key(s) colour"),
    ('{"tokens": [1]}', "required"),
    ('{"tokens": [], "max_new_tokens": 1}', "non-empty list"),
    ('{"tokens": "1 2", "max_new_tokens": 1}', "non-empty list"),
    ('{"tokens": [1, -1], "max_new_tokens": 1}', "integers in 0..4294967295"),
    ('{"tokens": [1, 2.5], "max_new_tokens": 1}', "integers in 0..4294967295"),
    ('{"tokens": [1, true], "max_new_tokens": 1}', "integers in 0..4294967295"),
    ('{"tokens": [4294967296], "max_new_tokens": 1}', "integers in 0..4294967295"),
    ('{"tokens": [1], "max_new_tokens": 0}', "'max_new_tokens' must be a positive integer"),
    ('{"tokens": [1], "max_new_tokens": "8"}', "'max_new_tokens' must be a positive integer"),
    ('{"tokens": [1, 2], "max_new_tokens": 1, "prefix_len": 3}', "'prefix_len' must be an integer in 0..2"),
    ('{"tokens": [1], "max_new_tokens": 1, "model": ""}', "'model' must be a non-empty string"),
    ('{"tokens": [1], "max_new_tokens": 1, "id": [1]}', "'id' must be a string or an integer"),
])
def test_bad_lines_say_what_is_wrong(line, words):
    with pytest.raises(ValueError) as err:
        parse_line(line)
    assert words in str(err.value)


def test_a_file_with_bad_lines_keeps_the_good_ones(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"tokens": [1, 2], "max_new_tokens": 4, "id": 1}),
        "{broken",
        "",
        json.dumps({"tokens": [], "max_new_tokens": 4, "id": 3}),
        json.dumps({"tokens": [9], "max_new_tokens": 2, "id": "last"}),
    ]) + "\n")
    out = list(read_prompts(path))
    assert [type(o) for o in out] == [Prompt, LineError, LineError, Prompt]
    assert [o.line for o in out] == [1, 2, 4, 5]
    assert [o.id for o in out if isinstance(o, Prompt)] == [1, "last"]
    assert str(out[1]).startswith(f"{path}:2: not JSON")


def test_text_lines_tokenized_in_chunks_keep_the_files_order(tmp_path):
    """Chats, token-id lines, bad lines and a text that tokenizes to nothing, over several chunks of
    ENCODE_LINES: one Prompt or LineError per line, in the file's order, each chat's tokens its own."""
    import json

    from shmbroker.bench.jobs_chat import make_tokenizer
    from shmbroker.commands.reading import ENCODE_LINES, read_prompts
    from shmbroker.jobs.text import Tokenizer

    tok = Tokenizer(make_tokenizer(tmp_path / "tok"))
    lines, want = [], []
    for i in range(ENCODE_LINES * 2 + 77):
        kind = i % 7
        if kind == 3:
            lines.append(json.dumps({"tokens": [1, 2, i + 1], "max_new_tokens": 2}))
            want.append(("ids", [1, 2, i + 1]))
        elif kind == 5:
            lines.append("{not json")
            want.append(("error", "not JSON"))
        elif i == 600:
            body = {"prompt": "   ", "max_tokens": 2}  # whitespace: no token
            lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}))
            want.append(("error", "empty once tokenized"))
        else:
            messages = [{"role": "user", "content": f"w{i}"}]
            lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"messages": messages, "max_tokens": 2}}))
            want.append(("chat", tok.encode(tok.chat_template().render(messages)).tolist()))
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    got = list(read_prompts(str(src), None, tok))
    assert [g.line for g in got] == list(range(1, len(lines) + 1))
    for g, (kind, what) in zip(got, want):
        if kind == "error":
            assert isinstance(g, LineError) and what in g.message, (g, what)
        else:
            assert g.tokens.tolist() == what
