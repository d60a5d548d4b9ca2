"""A consumer's `engine_settings.task`: `embed` is taken by the engines that embed and refused by name
for `trtllm`, whose LLM API has no pooling runner (the refusal says what to use instead)."""

from __future__ import annotations

import pytest

from shmbroker.config.settings import ConfigError, parse
from shmbroker.request.options import Task


def consumer(engine: str, task: str) -> dict:
    return {"consumers": [{"name": "card", "engine": engine, "max_batch_size": 4, "max_batch_tokens": 4096,
                           "max_input_len": 1024, "engine_settings": {"model": "/models/m", "task": task}}]}


def test_trtllm_refuses_the_embed_task_naming_what_serves_it():
    with pytest.raises(ConfigError) as err:
        parse(consumer("trtllm", "embed"))
    message = str(err.value)
    assert "consumers[0].engine_settings.task" in message
    assert "engine 'trtllm' does not embed: TensorRT-LLM's LLM API has no pooling runner" in message
    assert "`trtllm-serve embeddings` and use engine 'openai'" in message


@pytest.mark.parametrize("engine", ["vllm", "openai"])
def test_vllm_and_openai_take_the_embed_task(engine):
    assert parse(consumer(engine, "embed")).consumers[0].engine_settings.task is Task.EMBED
    assert parse(consumer("trtllm", "generate")).consumers[0].engine_settings.task is Task.GENERATE
