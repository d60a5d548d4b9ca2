"""A chat batch file, as users write it for the OpenAI Batch API, through a broker with a real vLLM
behind it (`tests/support/vllm_chat_check.py` under `.venv-vllm`), three ways: a `vllm` consumer
(the engine in the GPU process) with `submit`; the same broker's HTTP role (the OpenAI Files and
Batches API) driven by the real `openai` package; and an `openai` consumer in front of a real
`vllm serve`.

- every output line parses with `openai.types.chat.ChatCompletion`;
- each line's choices equal vLLM's own `LLM.chat` for the same messages and SamplingParams, run
  one request at a time: at temperature 0, and at temperature 0.8 with a seed (vLLM's per-request
  seeds hold across batch compositions here, through its engine and through its server);
- `n = 2` gives two choices; `usage.prompt_tokens` is the prompt vLLM rendered from the same
  template; `usage.prompt_tokens_details.cached_tokens` is vLLM's own counter (the lines share a
  system prompt, so some are served from the prefix cache);
- a line asking for logprobs (top 2): its `choices[0].logprobs` are vLLM's own, token by token,
  every way (the openai consumer reads the server's `top_logprobs` by token id);
- through HTTP the batch ends `completed`, every line counted completed, with no error file.
"""

from __future__ import annotations

import pytest
from support.vllm_venv import check_report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return check_report("vllm_chat_check.py", tmp_path_factory.mktemp("vllm-chat"), 1500)


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("way", ["vllm_engine", "http", "vllm_serve"])
def test_a_chat_batch_file_through_a_real_vllm_equals_vllms_own_chat(report, way):
    from openai.types.chat import ChatCompletion

    reqs, ref, run = report["requests"], report["reference"], report[way]
    assert run["supervisor_exit"] == 0, run["log_tail"]
    logprobs_line = f"line-{len(reqs) - 1}"
    if way == "http":  # the batch's own account: every line a request, each completed
        assert run["batch"]["status"] == "completed", (run["batch"], run["log_tail"])
        assert run["batch"]["request_counts"] == {"total": len(reqs), "completed": len(reqs), "failed": 0}
    else:
        assert run["submit_exit"] == 0, run["log_tail"]  # every line was a request
    got = {row["custom_id"]: row for row in run["out"]}
    assert sorted(got) == sorted(ref), run["log_tail"]
    cached = []
    for cid, want in ref.items():
        if cid not in got:
            continue
        body = reqs[int(cid.removeprefix("line-"))]
        reply = ChatCompletion.model_validate(got[cid]["response"]["body"])
        assert reply.object == "chat.completion"
        assert [c.message.content for c in reply.choices] == want["texts"], (cid, body)
        assert [c.finish_reason for c in reply.choices] == want["finish_reasons"], (cid, body)
        assert reply.usage.prompt_tokens == want["prompt_tokens"]
        assert reply.usage.completion_tokens >= len(reply.choices)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert len(got["line-8"]["response"]["body"]["choices"]) == 2
    assert all(c is not None and c >= 0 for c in cached) and max(cached) >= 32  # one system-prompt block at least
    assert run["errors"] == []
    content = ChatCompletion.model_validate(got[logprobs_line]["response"]["body"]).choices[0].logprobs.content
    want = ref[logprobs_line]["logprobs"]
    assert len(content) == len(want)
    for c, (own, top) in zip(content, want):
        assert c.logprob == pytest.approx(own, abs=1e-3)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top, abs=1e-3)
    sampled = [cid for cid in ref if reqs[int(cid.removeprefix("line-"))].get("temperature", 1.0) > 0]
    assert sampled and any(ref[c]["texts"] != ref[sampled[0]]["texts"] for c in sampled[1:])
