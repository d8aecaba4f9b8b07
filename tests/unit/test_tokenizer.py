"""FastTokenizer (tokenizers + Jinja, no transformers import) must match transformers' AutoTokenizer on
the same folder: ids, decoded text, special tokens and rendered chat templates."""

import json
import random

import pytest

from nanoinfer.testing.tiny_models import build_tokenizer
from nanoinfer.tokenizer import FastTokenizer, load_tokenizer

TEXTS = [
    "The capital of France is", "  leading spaces and\ttabs\nnew lines\n\n", "digits 1234567890 and 3.14159",
    "unicode: café naïve 東京 😀 🇫🇷", "<|im_start|>user\nhi<|im_end|>", "<|im_end|><|endoftext|>text after",
    "", " ", "code: def f(x): return {'a': [1, 2]}  # comment",
]  # fmt: skip
# A template in the style of recent chat models: namespace, loop controls, tojson, tools, reasoning, errors.
RICH_TEMPLATE = """{%- set ns = namespace(system=false) -%}
{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif -%}
{%- for message in messages %}
  {%- if message.role == 'system' %}{% set ns.system = true %}{% endif %}
  {%- if message.role not in ['system', 'user', 'assistant'] %}
{{ raise_exception('unknown role ' + message.role) }}{% endif %}
  {%- if message.role == 'assistant' and message.reasoning_content %}
<|im_start|>assistant
<think>{{ message.reasoning_content | trim }}</think>{{ message.content }}<|im_end|>
  {%- else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
  {%- endif %}
  {%- if loop.index0 > 8 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}{{ eos_token if not ns.system else '' }}"""
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning": "greet back"}, {"role": "user", "content": "é 😀"}],
]  # fmt: skip


def auto_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def tokenizer_folder(tmp_path, chat_template=None):
    tok = build_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(tmp_path)
    return tmp_path


def assert_same_as_transformers(folder, chats=CHATS):
    ours, theirs = FastTokenizer.from_folder(folder), auto_tokenizer(folder)
    assert isinstance(ours, FastTokenizer)
    assert (ours.bos_token, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token, theirs.eos_token_id, theirs.pad_token_id)  # fmt: skip
    assert len(ours) == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    special_ids = [i for i in (theirs.eos_token_id, theirs.pad_token_id) if i is not None]
    for n in (1, 2, 7, 40):
        ids = [rng.randrange(len(theirs)) for _ in range(n)] + special_ids
        rng.shuffle(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for chat in chats:
        for gen in (True, False):
            expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == expected


def test_tiny_tokenizer_matches_transformers(tmp_path):
    assert_same_as_transformers(tokenizer_folder(tmp_path))


def test_default_model_tokenizer_matches_transformers(default_model_dir):
    assert_same_as_transformers(default_model_dir)


def test_rich_chat_template_matches_transformers(tmp_path):
    folder = tokenizer_folder(tmp_path, RICH_TEMPLATE)
    assert_same_as_transformers(folder)
    ours, theirs = FastTokenizer.from_folder(folder), auto_tokenizer(folder)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "Zürich <b>"}}}]
    chat = CHATS[0]
    assert ours.apply_chat_template(chat, tools=tools) == theirs.apply_chat_template(chat, tools=tools, tokenize=False)
    assert "Zürich <b>" in ours.apply_chat_template(chat, tools=tools)  # tojson: no HTML escaping, no \\u escapes
    bad = [{"role": "robot", "content": "beep"}]
    for tok in (ours, theirs):
        with pytest.raises(Exception, match="unknown role robot"):
            tok.apply_chat_template(bad, tokenize=False)


def test_chat_template_does_not_modify_the_callers_messages(tmp_path):
    ours = FastTokenizer.from_folder(tokenizer_folder(tmp_path, RICH_TEMPLATE))
    chat = json.loads(json.dumps(CHATS[1]))
    ours.apply_chat_template(chat)
    assert chat == CHATS[1]


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    folder = tokenizer_folder(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "from config"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text("from file {{ messages[0].content }}")
    assert FastTokenizer.from_folder(folder).apply_chat_template(CHATS[0]) == "from file What is 2 + 2?"
    assert auto_tokenizer(folder).apply_chat_template(CHATS[0], tokenize=False) == "from file What is 2 + 2?"


@pytest.mark.parametrize("case", ["model-specific class", "generation tags", "template list", "no tokenizer.json",
                                  "remote code"])  # fmt: skip
def test_folders_only_transformers_reproduces_go_to_autotokenizer(tmp_path, case):
    folder = tokenizer_folder(tmp_path)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if case == "model-specific class":
        config["tokenizer_class"] = "Qwen2Tokenizer"
    elif case == "generation tags":
        (folder / "chat_template.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}"
                                                    "{% endgeneration %}{% endfor %}")  # fmt: skip
    elif case == "template list":
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config["chat_template"] = [{"name": "default", "template": "x"}]
    elif case == "no tokenizer.json":
        (folder / "tokenizer.json").unlink()
    config_path.write_text(json.dumps(config))
    assert FastTokenizer.from_folder(folder) is None or case == "remote code"
    if case in ("model-specific class", "generation tags", "remote code"):
        loaded = load_tokenizer(folder, trust_remote_code=case == "remote code")
        assert not isinstance(loaded, FastTokenizer)
        assert loaded.encode("The capital", add_special_tokens=False) == FastTokenizer.from_folder(
            tokenizer_folder(tmp_path / "plain")).encode("The capital", add_special_tokens=False)  # fmt: skip
