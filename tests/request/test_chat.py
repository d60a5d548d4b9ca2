"""Chat rendering: the same prompt text transformers' `apply_chat_template` renders, from the
template in a tokenizer directory, and clear errors for messages no template should see."""

from __future__ import annotations

import json

import pytest

from shmbroker.request.chat import ChatError, ChatTemplate, check_messages

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
          "{% endif %}")
# a template in the style of Llama 3's: the bos token, a loop control, a system message taken out,
# tojson of a message, raise_exception on a bad order
RICH = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% else %}{% set sys = 'default system' %}{% endif %}"
        "[SYS]{{ sys }}[/SYS]\n"
        "{% for m in messages %}{% if m['role'] == 'developer' %}{% continue %}{% endif %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token if m['role'] == 'assistant' else '' }}\n"
        "{% endfor %}{{ messages[-1] | tojson }}\n{% if add_generation_prompt %}<assistant>{% endif %}")

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? Ünïcødé"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
]


def tokenizer_dir(tmp_path, template, *, in_jinja=False, special=True):
    """A tokenizer directory as a model's holds one: tokenizer.json (trained here), its config with
    the chat template (or chat_template.jinja beside it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello there what is the answer"] * 3,
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    if special:
        config.update(bos_token="<s>", eos_token={"__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False,
                                                   "normalized": False, "single_word": False, "special": True})
    if in_jinja:
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("template", [CHATML, RICH], ids=["chatml", "rich"])
@pytest.mark.parametrize("in_jinja", [False, True], ids=["config", "jinja-file"])
def test_rendering_equals_transformers(tmp_path, template, in_jinja):
    from transformers import AutoTokenizer

    d = tokenizer_dir(tmp_path, template, in_jinja=in_jinja)
    hf = AutoTokenizer.from_pretrained(str(d))
    ours = ChatTemplate.from_dir(d)
    for chat in CHATS:
        want = hf.apply_chat_template(check_messages(chat), tokenize=False, add_generation_prompt=True)
        assert ours.render(chat) == want
    kwargs = {"enable_thinking": False}
    want = hf.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.render(CHATS[0], kwargs) == want


def test_named_templates_use_the_default(tmp_path):
    d = tokenizer_dir(tmp_path, [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML}])
    assert ChatTemplate.from_dir(d).render(CHATS[0]) == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("messages, says", [
    ([], "non-empty list"), ("hi", "non-empty list"), ([{"role": "robot", "content": "x"}], "messages\\[0\\].role"),
    ([{"role": "user", "content": 5}], "messages\\[0\\].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "content\\[0\\] must be a text part"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "tool_calls"), ([["user", "x"]], "messages\\[0\\] must be an object"),
])
def test_a_wrong_message_is_a_clear_error(messages, says):
    with pytest.raises(ChatError, match=says):
        check_messages(messages)


def test_template_errors_are_clear(tmp_path):
    rich = ChatTemplate.from_dir(tokenizer_dir(tmp_path, RICH))
    with pytest.raises(ChatError, match="roles must alternate"):
        rich.render([{"role": "assistant", "content": "first"}])
    with pytest.raises(ChatError, match="may not set add_generation_prompt"):
        rich.render(CHATS[0], {"add_generation_prompt": False})
    with pytest.raises(ChatError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatError, match="failed on these messages"):  # the sandbox refuses attribute games
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(CHATS[0])


def test_no_template_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatError, match="no chat template"):
        ChatTemplate.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatError, match="not readable JSON"):
        ChatTemplate.from_dir(tmp_path)
