"""`bench jobs`' chat part: a chat batch file with a tokenizer against the same job as token ids.

The chat file holds the seeded generator's prompts as `/v1/chat/completions` lines: each prompt's
token ids written as words (`w<id>`) in one user message, after a system message shared by its
family. A tokenizer made here (a word-level `tokenizer.json` whose vocabulary is those words, and a
ChatML `chat_template` in its `tokenizer_config.json`) renders and tokenizes them in `submit`
(`--tokenizer DIR`), as a user's model directory would. The token-id file holds, line for line, the
very ids that rendering gives (rendered here once, untimed, with the same code), as
`/v1/completions` lines: so both jobs put the same items through the same broker, and what differs
is the client's work on the text.

Both run `submit FILE --job --wait --out --out-format openai` with stderr to a pipe, alternated
`repeats` times. Figures: each side's wall seconds and submission seconds (the "submitted N items
in X s" line), `client_lines_per_s` (lines over the chat side's median submission seconds: template
rendering and tokenizing included), and `slowdown`, the chat side's median wall seconds over the
token-id side's.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..jobs import store

VOCAB = 4000  # the generator's token ids, and so the words of the tokenizer
SPECIAL = ("<unk>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SYSTEM_WORDS = 32  # the family's system message: the first so many of its prompt's words


def make_tokenizer(path: Path) -> Path:
    """A word-level tokenizer over SPECIAL, ROLES and w0..w{VOCAB-1}, with the ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    words = list(SPECIAL) + list(ROLES) + [f"w{i}" for i in range(VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|im_end|>",
        "chat_template": CHATML}))
    return path


def make_files(chat: Path, ids: Path, tok_dir: Path, num_items: int, seed: int) -> int:
    """The chat file and its token-id twin (module docstring); the prompt tokens of the twin."""
    from ..jobs.text import Tokenizer
    from ..workloads.synthetic import generate

    wl = generate(num_items, seed=seed, num_families=max(8, num_items // 250), system_tokens_median=48,
                  turn_tokens_median=24, reply_tokens_median=8, max_len=512, p_continue=0.3, vocab=VOCAB)
    tokenizer = Tokenizer(tok_dir)
    template = tokenizer.chat_template()
    tokens = 0
    with open(chat, "w") as fc, open(ids, "w") as fi:
        for i in range(len(wl)):
            words = [f"w{t}" for t in wl.tokens[wl.offsets[i] : wl.offsets[i + 1]].tolist()]
            messages = [{"role": "system", "content": " ".join(words[:SYSTEM_WORDS])},
                        {"role": "user", "content": " ".join(words[SYSTEM_WORDS:]) or "w0"}]
            max_tokens = int(min(16, wl.max_new_tokens[i]))
            fc.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": messages, "max_tokens": max_tokens}}) + "\n")
            rendered = tokenizer.encode(template.render(messages)).tolist()
            tokens += len(rendered)
            fi.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": rendered, "max_tokens": max_tokens}}) + "\n")
    return tokens


def chat_against_ids(data_dir: str, tmp: Path, num_items: int, seed: int, repeats: int, submit) -> dict:
    """Both jobs, alternated; `submit(argv)` runs `shmbroker ARGV` to its end: (wall seconds,
    submission seconds, its stderr)."""
    tok_dir = make_tokenizer(tmp / "tokenizer")
    chat, ids = tmp / "chat.jsonl", tmp / "chat-ids.jsonl"
    tokens = make_files(chat, ids, tok_dir, num_items, seed)
    runs: dict[str, list[tuple[float, float]]] = {"chat": [], "ids": []}
    for r in range(max(1, repeats)):
        for side in ("chat", "ids") if r % 2 == 0 else ("ids", "chat"):
            name = f"chat-{side}-{r}"
            out = tmp / f"{name}.jsonl"
            argv = ["submit", chat if side == "chat" else ids, "--data-dir", data_dir, "--job", name,
                    "--model", "default", "--wait", "--out", out, "--out-format", "openai"]
            seconds, submit_seconds, err = submit(argv + (["--tokenizer", tok_dir] if side == "chat" else []))
            view = store.view(data_dir, name)
            lines = sum(1 for _ in open(out))
            if lines != num_items or view["completed"] != num_items:
                raise RuntimeError(f"{name}: {lines} output lines, {view['completed']} completed: {err[-2000:]}")
            runs[side].append((seconds, submit_seconds))
            out.unlink()
    med = {side: [statistics.median(x[k] for x in v) for k in range(2)] for side, v in runs.items()}
    return {"lines": num_items, "tokens": tokens, "chat_file_bytes": chat.stat().st_size,
            "chat_seconds": [round(x[0], 3) for x in runs["chat"]], "ids_seconds": [round(x[0], 3) for x in runs["ids"]],
            "chat_submit_seconds": [round(x[1], 3) for x in runs["chat"]],
            "ids_submit_seconds": [round(x[1], 3) for x in runs["ids"]],
            "client_lines_per_s": round(num_items / med["chat"][1], 1) if med["chat"][1] else None,
            "slowdown": round(med["chat"][0] / med["ids"][0], 4)}
