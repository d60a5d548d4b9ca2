"""The configuration file: defaults, a full file, and every refusal naming its key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shmbroker.config import settings
from shmbroker.config.settings import ConfigError
from shmbroker.ring.items import model_id

CONSUMER = """
[[consumers]]
name = "a"
max_batch_size = 8
max_batch_tokens = 4096
max_input_len = 2048
"""


def write(tmp_path, text: str):
    path = tmp_path / "shmbroker.toml"
    path.write_text(text)
    return path


def test_missing_file_means_the_built_in_default(monkeypatch):
    monkeypatch.delenv("SHMBROKER_DATA_DIR", raising=False)
    cfg = settings.load(None)
    assert cfg.data_dir == "shmbroker-data" and cfg.fsync == "interval" and cfg.block_tokens == 512
    big, small = cfg.consumers
    assert (big.name, big.contract.max_batch_size, big.contract.max_batch_tokens, big.contract.max_input_len) == \
        ("big", 256, 131072, 131072)
    assert (small.name, small.contract.max_batch_size, small.contract.max_input_len) == ("small", 64, 16384)
    assert big.engine == small.engine == "sim"
    assert (big.engine_settings.cache_tokens, small.engine_settings.cache_tokens) == (2 << 20, 256 << 10)


def test_a_full_file(tmp_path):
    cfg = settings.load(write(tmp_path, """
data_dir = "/tmp/x"
instance = "blue-1"
ingest_processes = 2
ingest_ring_bytes = 4194304
result_ring_bytes = 8388608
segment_bytes = 16777216
fsync = "always"
fsync_interval_ms = 2.5
block_tokens = 256
max_wait_seconds = 12
padding_tolerance = 0.125
""" + CONSUMER + """model = "llama"
engine = "sim"
[consumers.engine_settings]
mode = "padded"
cache_tokens = 0
prefill_token_seconds = 1e-5
zero_cost = true
"""))
    assert (cfg.data_dir, cfg.instance, cfg.ingest_processes, cfg.fsync, cfg.block_tokens) == \
        ("/tmp/x", "blue-1", 2, "always", 256)
    assert cfg.max_wait_seconds == 12.0 and cfg.padding_tolerance == 0.125 and cfg.fsync_interval_ms == 2.5
    (c,) = cfg.consumers
    assert c.contract.model == model_id("llama") and c.model_name == "llama"
    assert c.engine_settings.mode == "padded" and c.engine_settings.cache_tokens == 0
    assert c.engine_settings.cost.prefill_token_seconds == 1e-5 and c.engine_settings.cost.zero_cost is True
    assert settings.load(write(tmp_path, CONSUMER), data_dir="/elsewhere").data_dir == "/elsewhere"


@pytest.mark.parametrize("text, key", [
    ("bogus = 1", "'bogus'"),
    ("fsync = 'sometimes'", "fsync:"),
    ("fsync_interval_ms = 0", "fsync_interval_ms:"),
    ("ingest_processes = 0", "ingest_processes:"),
    ("ingest_ring_bytes = 1000", "ingest_ring_bytes:"),
    ("ingest_ring_bytes = 65537", "ingest_ring_bytes:"),
    ("segment_bytes = 'big'", "segment_bytes:"),
    ("block_tokens = true", "block_tokens:"),
    ("max_wait_seconds = -1", "max_wait_seconds:"),
    ("padding_tolerance = nan", "padding_tolerance:"),
    ("instance = 'no spaces'", "instance:"),
    ("data_dir = ''", "data_dir:"),
    ("consumers = []", "consumers:"),
    (CONSUMER.replace("max_batch_size = 8", "max_batch_size = 0"), "consumers[0].max_batch_size:"),
    (CONSUMER.replace("max_input_len = 2048", "max_input_len = 5000"), "consumers[0].max_input_len:"),
    (CONSUMER.replace('name = "a"\n', ""), "consumers[0].name:"),
    (CONSUMER + "colour = 'red'\n", "'consumers[0].colour'"),
    (CONSUMER + "engine = 'tgi'\n", "consumers[0].engine:"),
    (CONSUMER + "model = 7\n", "consumers[0].model:"),
    (CONSUMER + "[consumers.engine_settings]\nmode = 'fast'\n", "consumers[0].engine_settings.mode:"),
    (CONSUMER + "[consumers.engine_settings]\nwarp = 9\n", "'consumers[0].engine_settings.warp'"),
    (CONSUMER + "[consumers.engine_settings]\nzero_cost = 1\n", "consumers[0].engine_settings.zero_cost:"),
    (CONSUMER + CONSUMER, "consumers: names must be unique"),
])
def test_refusals_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as err:
        settings.load(write(tmp_path, text))
    assert key in str(err.value) and str(tmp_path) in str(err.value)


def test_tokenizers_table_names_served_models_and_existing_tokenizers(tmp_path):
    """`[tokenizers]`: a served model (or `default`) -> its tokenizer directory, made absolute; an
    unserved model, a path with no tokenizer.json and a value that is no path are refused by name."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    cfg = settings.load(write(tmp_path, f'[tokenizers]\ndefault = "{tok}"\n' + CONSUMER))
    assert cfg.tokenizers == {"default": str(tok)}
    llama = CONSUMER + 'model = "llama"\n'
    assert settings.load(write(tmp_path, f'[tokenizers]\nllama = "{tok / "tokenizer.json"}"\n' + llama)).tokenizers == \
        {"llama": str(tok / "tokenizer.json")}
    for text, words in ((f'[tokenizers]\nmistral = "{tok}"\n' + llama, "tokenizers.mistral: no consumer or tier serves"),
                        (f'[tokenizers]\nllama = "{tmp_path}"\n' + llama, "tokenizers.llama: no tokenizer.json there"),
                        ("[tokenizers]\nllama = 3\n" + llama, "tokenizers.llama: must be a path"),
                        ("tokenizers = 3\n" + llama, "tokenizers: must be a table")):
        with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
            settings.load(write(tmp_path, text))


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such configuration file"):
        settings.load(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        settings.load(write(tmp_path, "fsync = "))


def test_cli_config_prints_the_resolved_file_or_refuses_it(tmp_path):
    good = write(tmp_path, CONSUMER)
    out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "config", "--config", str(good)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["consumers"][0]["contract"]["max_input_len"] == 2048 and shown["fsync"] == "interval"
    bad = tmp_path / "bad.toml"
    bad.write_text("fsync = 'sometimes'\n")
    out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "config", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "fsync: must be one of never, interval, always" in out.stderr
