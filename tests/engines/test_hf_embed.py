"""The `hf` engine embedding (`task = "embed"`, engines/hf_embed.py) on the CPU: through a real broker a
sentence-transformers directory's vectors equal sentence-transformers' own `encode` of each text
alone; a plain encoder pools (`mean`, `cls`, `last`) as a direct torch computation does; `dimensions`
is refused by name without `matryoshka` and cut and renormalised with it; bad items and settings
fail with words that say why."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf engine needs torch (the test extra installs it)")
transformers = pytest.importorskip("transformers", reason="the hf engine needs transformers")
pytest.importorskip("sentence_transformers", reason="sentence-transformers directories need it (the test extra)")

from support.brokerproc import serve  # noqa: E402

from shmbroker.bench.embed_model import CLS, SEP, bert_config, corpus, texts, write_model  # noqa: E402
from shmbroker.client.producer import Producer  # noqa: E402
from shmbroker.config import settings as config_settings  # noqa: E402
from shmbroker.engines.base import EngineBatch  # noqa: E402
from shmbroker.engines.catalogue import load_engine  # noqa: E402
from shmbroker.engines.hf import HF  # noqa: E402
from shmbroker.engines.hf_embed import HFEmbed  # noqa: E402
from shmbroker.engines.options import HFSettings  # noqa: E402
from shmbroker.request.extras import decode_extras  # noqa: E402
from shmbroker.request.options import Task, embedding  # noqa: E402

VOCAB = 1000
MAX_TOKENS = 128  # the directory's max_seq_length and positions
CONFIG = """
metrics_addr = ""
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2

[[consumers]]
name = "enc"
model = "enc"
engine = "hf"
max_batch_size = 8
max_batch_tokens = 2048
max_input_len = 256
engine_settings = {{ model = "{model}", task = "embed", device = "cpu", threads = 1 }}

[[consumers]]
name = "mat"
model = "mat"
engine = "hf"
max_batch_size = 8
max_batch_tokens = 2048
max_input_len = 256
engine_settings = {{ model = "{model}", task = "embed", device = "cpu", threads = 1, matryoshka = true }}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("st") / "model"), layers=2, hidden=64, vocab_size=VOCAB,
                       max_tokens=MAX_TOKENS, seed=4)


@pytest.fixture(scope="module")
def st(model_dir):
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    return SentenceTransformer(model_dir, device="cpu", local_files_only=True)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def _vector(r) -> np.ndarray:
    """An engine's ItemResult as its vector (marked a vector by its extras)."""
    assert r.status == "ok", r.error
    assert decode_extras(r.extras, r.tokens.size).vector
    return r.tokens.view(np.float32)


def _results(p: Producer, n: int) -> dict:
    got: dict = {}
    deadline = time.monotonic() + 90
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} results"
        for r in p.results(timeout_seconds=1.0):
            got[r.item_id] = r
    return got


@pytest.mark.timeout(180)
def test_through_the_broker_every_vector_is_sentence_transformers_own(tmp_path, model_dir, st):
    flat, offsets = corpus(48, vocab_size=VOCAB, max_tokens=MAX_TOKENS, seed=9)
    items = [flat[offsets[i] : offsets[i + 1]] for i in range(48)]
    text = texts(flat, offsets)
    assert st.tokenizer(text[0])["input_ids"] == items[0].tolist()  # the texts are these ids
    long_item = np.concatenate([[CLS], np.full(MAX_TOKENS, 7), [SEP]]).astype(np.uint32)  # 130 > 128
    with serve(tmp_path, "hfe", CONFIG.format(model=model_dir)) as broker, \
            Producer("embedder", data_dir=broker.data_dir) as p:
        ids = [p.embed(t, model="enc") for t in items]
        many = p.embed_many(flat, offsets, model="mat")
        refused = p.embed(items[0], model="enc", dimensions=16)
        cut = p.embed(items[1], model="mat", dimensions=16)
        too_long = p.embed(long_item, model="enc")
        unknown = p.embed(np.array([CLS, VOCAB + 5, SEP], np.uint32), model="enc")
        got = _results(p, 2 * 48 + 4)
    for k, (i, j) in enumerate(zip(ids, many.tolist())):
        want = st.encode([text[k]])[0]  # that text alone, through sentence-transformers' own encode
        for r in (got[i], got[j]):
            assert r.status == "ok", r.error
            assert r.vector.size == want.size == 64
            assert _cosine(r.vector, want) >= 0.99999
    assert got[refused].status == "invalid" and "'dimensions'" in got[refused].error
    v = got[cut].vector
    head = st.encode([text[1]])[0][:16]
    assert v.size == 16 and abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    assert _cosine(v, head) >= 0.99999  # the first 16 values, renormalised
    assert got[too_long].status == "invalid" and "more than the model takes (128" in got[too_long].error
    assert got[unknown].status == "invalid" and "vocabulary" in got[unknown].error


def _direct(settings: HFSettings, tokens: np.ndarray, how: str) -> np.ndarray:
    """The item alone through the same random weights, pooled by hand."""
    raw = dict(settings.config)
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(settings.seed)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    with torch.inference_mode():
        hidden = model(input_ids=torch.as_tensor(tokens.astype(np.int64))[None]).last_hidden_state[0]
    vec = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[how]
    return vec.numpy()


@pytest.mark.parametrize("how", ["mean", "cls", "last"])
def test_a_plain_encoder_pools_as_a_direct_computation(how):
    cfg = bert_config(2, 64, VOCAB, MAX_TOKENS)
    settings = HFSettings(config=cfg, task=Task.EMBED, device="cpu", threads=1, seed=2, pooling=how,
                          normalize=how == "cls")
    engine = HF(settings)
    assert isinstance(engine, HFEmbed) and engine.dims == 64
    rng = np.random.default_rng(3)
    items = [rng.integers(5, VOCAB, int(n)).astype(np.uint32) for n in (5, 40, 17, 1, 33)]  # padded right
    out = engine.run(EngineBatch(np.arange(5, dtype=np.uint64), items, np.zeros(5, np.int64)))
    assert out.rect_tokens == 5 * 40 and out.padded_tokens == 5 * 40 - sum(t.size for t in items)
    for r, t in zip(out.results, items):
        want, got = _direct(settings, t, how), _vector(r)
        assert got.size == 64
        assert _cosine(got, want) >= 0.99999
        if how == "cls":  # normalize: length 1
            assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
        else:
            assert np.allclose(got, want, atol=1e-4)


def test_dimensions_are_honoured_only_where_matryoshka_is_declared(model_dir):
    plain = load_engine("hf", HFSettings(model=model_dir, task=Task.EMBED, device="cpu", threads=1))
    mat = load_engine("hf", HFSettings(model=model_dir, task=Task.EMBED, device="cpu", threads=1, matryoshka=True))
    try:
        assert "dimensions" not in plain.honours and "embed" in plain.honours
        assert "dimensions" in mat.honours
        item = np.array([CLS, 10, 11, 12, SEP], np.uint32)
        out = mat.run(EngineBatch(np.arange(3, dtype=np.uint64), [item] * 3, np.zeros(3, np.int64),
                                  options=[embedding(8), embedding(None), embedding(65)]))
        cut, whole, over = out.results
        cut, whole = _vector(cut), _vector(whole)
        assert cut.size == 8 and whole.size == 64
        assert np.allclose(cut, whole[:8] / np.linalg.norm(whole[:8]), atol=1e-6)
        assert over.status == "invalid" and "'dimensions' 65" in over.error
    finally:
        plain.close()
        mat.close()


def test_a_config_that_lists_matryoshka_cuts_honours_those_alone():
    cfg = {**bert_config(2, 64, VOCAB, MAX_TOKENS), "matryoshka_dimensions": [16, 32]}
    engine = load_engine("hf", HFSettings(config=cfg, task=Task.EMBED, device="cpu", threads=1))
    try:
        assert "dimensions" in engine.honours  # declared by the model, not the settings
        item = np.array([CLS, 10, 11, SEP], np.uint32)
        out = engine.run(EngineBatch(np.arange(3, dtype=np.uint64), [item] * 3, np.zeros(3, np.int64),
                                     options=[embedding(16), embedding(20), embedding(64)]))
        listed, unlisted, whole = out.results
        assert _vector(listed).size == 16 and _vector(whole).size == 64
        assert unlisted.status == "invalid" and "not a cut the model declares (16, 32)" in unlisted.error
    finally:
        engine.close()


def test_bad_settings_say_which_key(model_dir, tmp_path):
    with pytest.raises(ValueError, match="pooling: must be one of"):
        HFSettings(config={"model_type": "bert"}, task=Task.EMBED, pooling="max")
    with pytest.raises(ValueError, match=r"pooling, matryoshka: only with task = \"embed\""):
        HFSettings(config={"model_type": "bert"}, pooling="cls", matryoshka=True)
    with pytest.raises(ValueError, match="its own Pooling module"):
        HF(HFSettings(model=model_dir, task=Task.EMBED, device="cpu", pooling="cls"))
    path = tmp_path / "bad.toml"
    path.write_text('[[consumers]]\nname = "x"\nengine = "hf"\nmax_batch_size = 8\nmax_batch_tokens = 2048\n'
                    'max_input_len = 256\nengine_settings = { config = { model_type = "bert" }, normalize = true }\n')
    with pytest.raises(config_settings.ConfigError, match="normalize: only with task"):
        config_settings.load(str(path))


@pytest.mark.timeout(180)
def test_an_embeddings_batch_file_through_the_hf_engine_equals_sentence_transformers(tmp_path, model_dir, st):
    """`/v1/embeddings` lines (a string, an array of strings, token ids, arrays of token ids; float and
    base64) through `submit --job`, texts tokenized with the directory's own tokenizer: every vector
    is sentence-transformers' `encode` of that input alone."""
    import base64
    import json
    import os

    from openai.types import CreateEmbeddingResponse

    from shmbroker.cli import main

    flat, offsets = corpus(40, vocab_size=VOCAB, max_tokens=MAX_TOKENS, seed=11)
    items = [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(40)]
    text = texts(flat, offsets)
    rows, want = [], {}
    for k in range(0, 36, 2):
        kind = (k // 2) % 4
        inputs = [text[k]] if kind == 0 else [text[k], text[k + 1]] if kind == 1 else [items[k]] if kind == 2 else \
            [items[k], items[k + 1]]
        body = {"model": "enc", "input": inputs[0] if kind in (0, 2) else inputs}
        if kind in (1, 3):
            body["encoding_format"] = "base64"
        rows.append({"custom_id": f"e{k}", "method": "POST", "url": "/v1/embeddings", "body": body})
        want[f"e{k}"] = st.encode([text[k]] if kind in (0, 2) else [text[k], text[k + 1]])
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
    with serve(tmp_path, "hfj", CONFIG.format(model=model_dir)) as broker:
        assert main(["submit", str(src), "--data-dir", broker.data_dir, "--job", "emb", "--tokenizer", model_dir,
                     "--wait", "--out", str(out), "--out-format", "openai"]) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(got) == sorted(want)
    for cid, body in got.items():
        for d in body["data"]:
            if isinstance(d["embedding"], str):
                d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()
        reply = CreateEmbeddingResponse.model_validate(body)
        assert len(reply.data) == len(want[cid])
        for d, w in zip(reply.data, want[cid]):
            assert len(d.embedding) == w.size and _cosine(np.array(d.embedding, np.float32), w) >= 0.99999
