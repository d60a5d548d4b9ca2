"""Tiers: a card's memory picks its engine and contract; `supervise --gpus auto` makes one consumer per card.

Selection from memory sizes (two sizes, the exact boundary, a card too small for any tier), the
`[[tiers]]`/`[[gpus]]` tables and their refusals, card detection through a test double of `pynvml`
(CUDA_VISIBLE_DEVICES honoured), the fallback to `[[gpus]]`, and the CLI end to end: a real broker
whose two declared cards get consumers card0 and card1 on different tiers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from shmbroker.config import settings
from shmbroker.config.settings import ConfigError, SimSettings
from shmbroker.engines.options import HFSettings
from shmbroker.gpu import tiers
from shmbroker.gpu.tiers import GIB, Card, Tier, TierError, consumers_for, select_tier
from shmbroker.ring.items import model_id

BIG = Tier("big", 75.0, "sim", SimSettings("packed", 1 << 20), 256, 131072, 32768, "llama")
SMALL = Tier("small", 22.0, "sim", SimSettings("padded", 1 << 16), 32, 16384, 8192, "llama")

TIERS_TOML = """
[[tiers]]
name = "big"
min_memory_gib = 75
max_batch_size = 256
max_batch_tokens = 131072
max_input_len = 32768
engine = "hf"
engine_settings = { model = "/models/llama", dtype = "bfloat16" }

[[tiers]]
name = "small"
min_memory_gib = 22
max_batch_size = 32
max_batch_tokens = 16384
max_input_len = 8192
engine_settings = { mode = "padded", cache_tokens = 65536 }
"""

GPUS_TOML = """
[[gpus]]
index = 0
memory_gib = 80
name = "A100-80"

[[gpus]]
index = 1
memory_gib = 24
"""

CONSUMER = """
[[consumers]]
name = "a"
max_batch_size = 8
max_batch_tokens = 4096
max_input_len = 2048
"""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "shmbroker.toml"
    path.write_text(text)
    return path


def card(index: int, memory_bytes: int, name: str = "GPU") -> Card:
    return Card(index, name, memory_bytes)


# -- selection --------------------------------------------------------------------------


def test_two_cards_of_different_sizes_get_different_tiers():
    assert select_tier(card(0, 80 * GIB), (SMALL, BIG)) is BIG
    assert select_tier(card(1, 24 * GIB), (SMALL, BIG)) is SMALL
    assert select_tier(card(2, 141 * GIB), (BIG, SMALL)) is BIG  # the largest tier it reaches, in any order


def test_the_boundary_is_inclusive_to_the_byte():
    assert select_tier(card(0, 75 * GIB), (SMALL, BIG)) is BIG
    assert select_tier(card(0, 75 * GIB - 1), (SMALL, BIG)) is SMALL
    assert select_tier(card(0, 22 * GIB), (SMALL, BIG)) is SMALL


def test_a_card_too_small_for_any_tier_is_a_clear_error():
    with pytest.raises(TierError) as err:
        select_tier(card(3, 16 * GIB, "Tesla T4"), (BIG, SMALL))
    msg = str(err.value)
    assert "card 3" in msg and "Tesla T4" in msg and "16 GiB" in msg, msg
    assert "'small'" in msg and "min_memory_gib = 22" in msg, msg
    with pytest.raises(TierError, match=r"21\.9 GiB"):
        select_tier(card(0, 22 * GIB - GIB // 10), (BIG, SMALL))
    with pytest.raises(TierError, match="at least one"):
        select_tier(card(0, 80 * GIB), ())


def test_consumers_for_carries_the_tier_and_pins_each_card():
    big, small = consumers_for([card(0, 80 * GIB), card(3, 24 * GIB)], (SMALL, BIG))
    assert (big.name, big.device, big.engine, big.engine_settings) == ("card0", 0, "sim", BIG.engine_settings)
    assert (big.contract.max_batch_size, big.contract.max_batch_tokens, big.contract.max_input_len) == (256, 131072, 32768)
    assert big.contract.model == model_id("llama") and big.model_name == "llama"
    assert (small.name, small.device, small.engine_settings.mode) == ("card3", 3, "padded")
    assert (small.contract.max_batch_size, small.contract.max_batch_tokens, small.contract.max_input_len) == (32, 16384, 8192)
    default = consumers_for([card(0, 80 * GIB)], (Tier("t", 0, "sim", SimSettings(), 4, 64, 64),))[0]
    assert default.contract.model == 0 and default.model_name is None


# -- the configuration ------------------------------------------------------------------


def test_tiers_and_gpus_parse_and_leave_consumers_alone(tmp_path):
    cfg = settings.load(write(tmp_path, CONSUMER + TIERS_TOML + GPUS_TOML))
    assert [c.name for c in cfg.consumers] == ["a"] and cfg.consumers[0].device is None
    big, small = cfg.tiers
    assert (big.name, big.min_memory_gib, big.engine, big.max_batch_size, big.max_input_len) == ("big", 75.0, "hf", 256, 32768)
    assert big.engine_settings == HFSettings(model="/models/llama", dtype="bfloat16")
    assert (small.engine, small.engine_settings, small.model) == ("sim", SimSettings("padded", 65536), None)
    assert cfg.gpus == (Card(0, "A100-80", 80 * GIB), Card(1, "GPU", 24 * GIB))
    plain = settings.as_dict(cfg)
    assert plain["tiers"][0]["engine_settings"]["model"] == "/models/llama" and plain["gpus"][1]["memory_bytes"] == 24 * GIB
    json.dumps(plain)
    assert settings.load(write(tmp_path, CONSUMER)).tiers == () and settings.load(None).gpus == ()


TIER = """
[[tiers]]
name = "t"
min_memory_gib = 20
max_batch_size = 8
max_batch_tokens = 4096
max_input_len = 2048
"""


@pytest.mark.parametrize("text,key", [
    (TIER.replace("min_memory_gib = 20\n", ""), "tiers[0].min_memory_gib: is required"),
    (TIER.replace("min_memory_gib = 20", "min_memory_gib = -1"), "tiers[0].min_memory_gib: must be"),
    (TIER.replace("min_memory_gib = 20", "min_memory_gib = '80G'"), "tiers[0].min_memory_gib: must be a number"),
    (TIER + TIER.replace('"t"', '"u"').replace("max_batch_size = 8", "max_batch_size = 0"), "tiers[1].max_batch_size:"),
    (TIER.replace("max_input_len = 2048", "max_input_len = 8192"), "tiers[0].max_input_len: must be <= max_batch_tokens"),
    (TIER + "warp = 1\n", "'tiers[0].warp'"),
    (TIER + "engine = 'tpu'\n", "tiers[0].engine: must be one of"),
    (TIER + "engine_settings = { warp = 9 }\n", "'tiers[0].engine_settings.warp'"),
    (TIER + "engine = 'hf'\nengine_settings = { dtype = 'float16' }\n", "tiers[0].engine_settings: engine 'hf' needs"),
    (TIER + TIER.replace("min_memory_gib = 20", "min_memory_gib = 40"), "tiers: names must be unique"),
    (TIER + TIER.replace('"t"', '"u"'), "tiers: min_memory_gib must differ"),
    ("tiers = []\n", "tiers: must be a non-empty array"),
    ("[[gpus]]\nmemory_gib = 24\n", "gpus[0].index: is required"),
    ("[[gpus]]\nindex = 0\n", "gpus[0].memory_gib: is required"),
    ("[[gpus]]\nindex = 0\nmemory_gib = 0\n", "gpus[0].memory_gib: must be > 0"),
    ("[[gpus]]\nindex = -1\nmemory_gib = 24\n", "gpus[0].index: must be"),
    ("[[gpus]]\nindex = 0\nmemory_gib = 24\nuuid = 'x'\n", "'gpus[0].uuid'"),
    ("[[gpus]]\nindex = 0\nmemory_gib = 24\n[[gpus]]\nindex = 0\nmemory_gib = 80\n", "gpus: indexes must be unique"),
])
def test_refusals_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as err:
        settings.load(write(tmp_path, text))
    assert key in str(err.value) and str(tmp_path) in str(err.value), str(err.value)


# -- detecting cards --------------------------------------------------------------------


class NVMLError(Exception):
    pass


def fake_pynvml_test_double(cards: list[tuple[str, int, str]], fail: bool = False) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's `pynvml`: the cards as (name, total bytes, uuid); names as bytes
    for the first card (old nvidia-ml-py returned bytes)."""
    mod = types.ModuleType("pynvml")
    mod.calls = []

    def init():
        mod.calls.append("init")
        if fail:
            raise NVMLError("Driver Not Loaded")

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: mod.calls.append("shutdown")
    mod.nvmlDeviceGetCount = lambda: len(cards)
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: cards[h][0].encode() if h == 0 else cards[h][0]
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=cards[h][1], free=0, used=0)
    mod.nvmlDeviceGetUUID = lambda h: cards[h][2]
    return mod


THREE = [("NVIDIA H200", 143771 << 20, "GPU-aaaa1111"), ("NVIDIA L4", 23034 << 20, "GPU-bbbb2222"),
         ("NVIDIA A100-SXM4-80GB", 80 * GIB, "GPU-cccc3333")]


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(cards=THREE, fail=False):
        mod = fake_pynvml_test_double(cards, fail)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod

    return install


def test_detect_cards_reads_nvml(nvml):
    mod = nvml()
    cards = tiers.detect_cards()
    assert [(c.index, c.name, c.memory_bytes, c.uuid) for c in cards] == \
        [(i, n, m, u) for i, (n, m, u) in enumerate(THREE)]
    assert mod.calls == ["init", "shutdown"]


@pytest.mark.parametrize("mask,indexes", [
    ("2,0", [2, 0]),  # CUDA's order of the list
    ("1", [1]),
    ("0,7,2", [0]),  # like CUDA: the list ends at the first entry that names no card
    ("GPU-bbbb2222,GPU-cccc", [1, 2]),  # UUIDs, and unique prefixes of them
    ("GPU-", []),  # a prefix of all three: ambiguous, names no card
    ("", []),
    ("-1", []),
    ("MIG-0f3a,0", []),  # a MIG slice's memory is not the card's
])
def test_detect_cards_honours_cuda_visible_devices(nvml, monkeypatch, mask, indexes):
    nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    assert [c.index for c in tiers.detect_cards()] == indexes
    if not indexes:
        assert "CUDA_VISIBLE_DEVICES" in tiers.probe_nvml()[1]


def test_no_cards_without_pynvml_or_a_driver(nvml, monkeypatch):
    mod = nvml(fail=True)
    assert tiers.probe_nvml() == ([], "NVML did not start: Driver Not Loaded") and mod.calls == ["init"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    cards, why = tiers.probe_nvml()
    assert cards == [] and "not installed" in why
    assert tiers.detect_cards() == []


def test_gpus_auto_uses_nvml_else_the_declared_cards(tmp_path, nvml, monkeypatch):
    cfg = settings.load(write(tmp_path, TIERS_TOML + GPUS_TOML))
    nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    lines = []
    auto = tiers.apply_gpus_auto(cfg, say=lines.append)
    assert [(c.name, c.device, c.engine) for c in auto.consumers] == [("card1", 1, "sim"), ("card0", 0, "hf")]
    assert auto.tiers == cfg.tiers and cfg.consumers == settings.default_consumers()
    assert lines[1] == "card 1 NVIDIA L4 22.5 GiB -> tier small (sim) as consumer card1", lines
    assert lines[2].startswith("card 0 NVIDIA H200 140.4 GiB -> tier big (hf)"), lines
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # (with it, the declared cards follow its order too)
    lines.clear()
    auto = tiers.apply_gpus_auto(cfg, say=lines.append)
    assert [(c.name, c.device, c.contract.max_batch_size) for c in auto.consumers] == [("card0", 0, 256), ("card1", 1, 32)]
    assert "[[gpus]]" in lines[0] and "not installed" in lines[0], lines
    assert lines[1:] == ["card 0 A100-80 80 GiB -> tier big (hf) as consumer card0",
                         "card 1 GPU 24 GiB -> tier small (sim) as consumer card1"]


def test_gpus_auto_refusals(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(TierError, match=r"needs at least one \[\[tiers\]\]"):
        tiers.apply_gpus_auto(settings.load(write(tmp_path, GPUS_TOML)), say=print)
    with pytest.raises(TierError, match=r"no cards: .*not installed.*declares no \[\[gpus\]\]"):
        tiers.apply_gpus_auto(settings.load(write(tmp_path, TIERS_TOML)), say=print)
    tiny = TIERS_TOML + "[[gpus]]\nindex = 0\nmemory_gib = 16\nname = 'T4'\n"
    with pytest.raises(TierError, match=r"card 0 \(T4, 16 GiB\) fits no tier.*'small'.*min_memory_gib = 22"):
        tiers.apply_gpus_auto(settings.load(write(tmp_path, tiny)), say=print)


def test_the_gpu_process_pins_itself_before_loading_its_engine(monkeypatch):
    from shmbroker.gpu.consumer import gpu_main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    pinned = consumers_for([card(3, 24 * GIB)], (SMALL,))
    cfg = settings.BrokerConfig(data_dir="unused", consumers=pinned)
    no_roles = types.SimpleNamespace(roles=[])  # gpu_main stops at its role lookup, after pinning
    with pytest.raises(ValueError):
        gpu_main(0, cfg, no_roles, None, None, lambda: 0)
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["CUDA_DEVICE_ORDER"]) == ("3", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError):
        gpu_main(0, settings.load(None), no_roles, None, None, lambda: 0)  # not pinned: left alone
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


# -- the CLI ----------------------------------------------------------------------------

SIM_TIERS = """
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 5.0
metrics_addr = ""

[[consumers]]
name = "handwritten"
max_batch_size = 4
max_batch_tokens = 1024
max_input_len = 1024

[[tiers]]
name = "big"
min_memory_gib = 75
max_batch_size = 64
max_batch_tokens = 65536
max_input_len = 8192
engine = "sim"
engine_settings = { mode = "packed", cache_tokens = 262144 }

[[tiers]]
name = "small"
min_memory_gib = 22
max_batch_size = 16
max_batch_tokens = 8192
max_input_len = 2048
engine = "sim"
engine_settings = { mode = "padded", cache_tokens = 65536 }
"""


@pytest.fixture
def no_nvml_env(tmp_path):
    """The subprocess's environment with a test double of pynvml whose NVML never starts, so that
    the declared [[gpus]] are used even where nvidia-ml-py and a card are present."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "pynvml.py").write_text('"""Test double: NVML without a driver."""\n\n\n'
                                    'def nvmlInit():\n    raise RuntimeError("test double: no driver")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stub)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def cli(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmbroker.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_config_gpus_auto_prints_the_consumers(tmp_path, no_nvml_env):
    path = write(tmp_path, SIM_TIERS + GPUS_TOML)
    out = cli("config", "--config", str(path), "--gpus", "auto", env=no_nvml_env)
    assert out.returncode == 0, out.stderr
    consumers = json.loads(out.stdout)["consumers"]
    assert [(c["name"], c["device"], c["contract"]["max_batch_size"]) for c in consumers] == [("card0", 0, 64), ("card1", 1, 16)]
    assert "card 1 GPU 24 GiB -> tier small (sim) as consumer card1" in out.stderr
    out = cli("config", "--config", str(path), env=no_nvml_env)
    assert [c["name"] for c in json.loads(out.stdout)["consumers"]] == ["handwritten"]


def test_cli_supervise_gpus_auto_starts_one_consumer_per_card(tmp_path, no_nvml_env):
    path = write(tmp_path, SIM_TIERS + GPUS_TOML)
    data_dir = tmp_path / "data"
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "supervise", "--config", str(path),
                                 "--data-dir", str(data_dir), "--gpus", "auto"],
                                stdout=log, stderr=subprocess.STDOUT, env=no_nvml_env)
    try:
        deadline = time.monotonic() + 90
        desc = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                desc = json.loads((data_dir / "broker.json").read_text())
                break
            except (FileNotFoundError, ValueError):
                time.sleep(0.05)
        assert desc is not None, log_path.read_text()
        assert [r for r in desc["roles"] if r.startswith("gpu-")] == ["gpu-card0", "gpu-card1"]
        by_name = {c["name"]: c for c in desc["consumers"]}
        assert (by_name["card0"]["mode"], by_name["card0"]["max_batch_size"]) == ("packed", 64)
        assert (by_name["card1"]["mode"], by_name["card1"]["max_batch_size"]) == ("padded", 16)
        time.sleep(0.5)
        assert proc.poll() is None, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    text = log_path.read_text()
    assert code == 0, text
    assert "card 0 A100-80 80 GiB -> tier big (sim) as consumer card0" in text, text


def test_cli_supervise_gpus_auto_refuses_a_card_too_small(tmp_path, no_nvml_env):
    path = write(tmp_path, SIM_TIERS + GPUS_TOML + "[[gpus]]\nindex = 2\nmemory_gib = 16\nname = 'T4'\n")
    out = cli("supervise", "--config", str(path), "--data-dir", str(tmp_path / "data"), "--gpus", "auto",
              env=no_nvml_env)
    assert out.returncode == 2, out.stderr
    assert "shmbroker: card 2 (T4, 16 GiB) fits no tier: the smallest, 'small', needs min_memory_gib = 22" in out.stderr
    assert not (tmp_path / "data" / "broker.json").exists()
    out = cli("supervise", "--config", str(write(tmp_path, SIM_TIERS)), "--data-dir", str(tmp_path / "data"),
              "--gpus", "auto", env=no_nvml_env)
    assert out.returncode == 2 and "declares no [[gpus]]" in out.stderr, out.stderr


def test_a_mask_that_hides_every_card_does_not_fall_back_to_declared_cards(nvml, monkeypatch):
    """NVML works but CUDA_VISIBLE_DEVICES lets no whole card through (a MIG slice, empty): the declared
    [[gpus]] must not be used, or each GPU process would pin itself to a card outside the mask."""
    cfg = settings.parse({"tiers": [{"name": "t", "min_memory_gib": 1, "engine": "sim", "max_batch_size": 4,
                                     "max_batch_tokens": 4096, "max_input_len": 1024}],
                          "gpus": [{"index": 0, "memory_gib": 80}]})
    for mask in ("MIG-1234", ""):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
        with pytest.raises(tiers.TierError, match="CUDA_VISIBLE_DEVICES"):
            tiers.apply_gpus_auto(cfg, say=lambda line: None)
