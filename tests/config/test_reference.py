"""docs/configuration.md is generated from the settings' fields, and every key the file takes is in it."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shmbroker.cluster.options import NatsOptions, NodeSettings
from shmbroker.cluster.subjects import ClusterNames, StreamSettings
from shmbroker.config import reference, settings
from shmbroker.config.broker import BrokerConfig, Card, Tier, key_name, toml_keys
from shmbroker.config.cluster import CLUSTER_KEYS
from shmbroker.config.engines import SIM_CHECKS
from shmbroker.engines.catalogue import ENGINES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def test_the_reference_page_is_what_the_fields_generate():
    assert DOC.read_text() == reference.markdown(), (
        f"docs/configuration.md differs from the settings' fields; regenerate it: {reference.REGENERATE}")


def test_the_cli_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "config", "--reference"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference.markdown()


def keys_of(section: str) -> list[str]:
    """The keys in the first column of the tables under the `## <section>` heading of the page."""
    text = reference.markdown().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)


def test_every_key_the_file_takes_is_documented_once():
    top = [f.metadata.get("table", f.name) for f in toml_keys(BrokerConfig)]
    assert keys_of("Top-level keys") == top
    assert {f.name for f in dataclasses.fields(BrokerConfig)} - {f.name for f in toml_keys(BrokerConfig)} == {"source"}
    assert keys_of("`[[consumers]]`") == list(settings.CONSUMER_KEYS)
    assert keys_of("`[[tiers]]`") == list(settings.TIER_KEYS) == [key_name(f) for f in toml_keys(Tier)]
    assert keys_of("`[[gpus]]`") == [key_name(f) for f in toml_keys(Card)] == ["index", "name", "memory_gib"]
    assert sorted(keys_of("`[cluster]`")) == sorted(CLUSTER_KEYS)
    holders = (NatsOptions, ClusterNames, StreamSettings, NodeSettings)
    assert sum(len(toml_keys(h)) for h in holders) == len(CLUSTER_KEYS)
    per_engine = reference.markdown().split("\n## `engine_settings`\n", 1)[1].split("\n## ", 1)[0].split("\n### ")[1:]
    assert [s.split("`")[1] for s in per_engine] == [f'engine = "{name}"' for name in ENGINES]
    sim = re.findall(r"^\| `([^`]+)` \|", per_engine[0], flags=re.M)
    assert sorted(sim) == sorted(SIM_CHECKS)
    for section, e in zip(per_engine[1:], list(ENGINES.values())[1:]):
        keys = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
        assert keys == [f.name for f in dataclasses.fields(e.settings_class())], e.name  # every field is a key


def test_every_key_has_a_one_line_help():
    classes = [BrokerConfig, Tier, Card, NatsOptions, ClusterNames, StreamSettings, NodeSettings]
    classes += [e.settings_class() for e in ENGINES.values()]
    for cls in classes:
        for f in toml_keys(cls):
            assert f.metadata["help"] and "\n" not in f.metadata["help"], (cls.__name__, f.name)


def test_the_defaults_of_a_file_without_keys_are_the_fields():
    cfg = settings.parse({}, data_dir="/d")
    for f in toml_keys(BrokerConfig):
        if f.default is not dataclasses.MISSING:
            assert getattr(cfg, f.name) == f.default, f.name
    assert cfg.consumers == settings.default_consumers()


def test_the_minimal_example_is_a_valid_file():
    cfg = settings.parse(tomllib.loads(reference.EXAMPLE), "example.toml")
    (gpu0,) = cfg.consumers
    assert (gpu0.name, gpu0.engine, gpu0.engine_settings.model) == ("gpu0", "vllm", "/models/llama-3-8b")
    assert "```toml\n" + reference.EXAMPLE in DOC.read_text()


@pytest.mark.parametrize("value, text", [(8 << 20, "8388608 (8 MiB)"), (1 << 30, "1073741824 (1 GiB)"),
                                         (5000, "5000"), (None, "none"), (True, "`true`"), (0.04, "0.04")])
def test_defaults_read_as_a_file_would_write_them(value, text):
    assert reference.value_text(value, "x_bytes" if isinstance(value, int) and value > 4096 else "x") == text
