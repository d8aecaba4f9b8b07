"""The model's tokenizer: the `tokenizers` library directly where that is exact, transformers otherwise.

transformers' AutoTokenizer costs about 3.5 s of imports, a third of the default model's startup. A model
folder whose tokenizer_config.json names the generic fast tokenizer (PreTrainedTokenizerFast or
TokenizersBackend) is, in transformers, tokenizer.json as written plus named special tokens and a Jinja
chat template. FastTokenizer does exactly that, with the same sandboxed Jinja setup. Every other folder
(a model-specific tokenizer class, a sentencepiece-only folder, trust_remote_code, templates that need
transformers' extensions) is loaded by AutoTokenizer as before. tests/unit/test_tokenizer.py compares the
two on encode, decode and chat templates.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

# Classes that transformers builds from tokenizer.json unchanged (model-specific classes rebuild parts).
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
# Names a message's reasoning may come under; chat templates read `reasoning_content` (as transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    """FastTokenizer when the folder allows it, else transformers' AutoTokenizer (same interface subset)."""
    fast = None if trust_remote_code else FastTokenizer.from_folder(model_dir)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


# The chat template rendering's own arguments: its options (chat_template_kwargs) may not set them
TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
                                "continue_final_message", "return_dict", "conversation"})


def template_kwargs_problem(value) -> str | None:
    """What is wrong with chat template options (chat_template_kwargs), or None: not an object, or setting one of
    the rendering's own arguments."""
    if not isinstance(value, dict):
        json_type = {list: "an array", str: "a string", bool: "true or false", int: "a number", float: "a number",
                     type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip
        return f"must be a JSON object, got {json_type}."
    reserved = sorted(set(value) & TEMPLATE_ARGUMENTS)
    if reserved:
        return f"may not set {', '.join(reserved)}: nanoinfer renders the messages and tools with the model's template."
    return None


class FastTokenizer:
    """tokenizer.json through `tokenizers`, with the part of transformers' tokenizer API nanoinfer uses."""

    def __init__(self, backend, special_tokens: dict[str, str], chat_template: str | None = None):
        self.backend = backend  # tokenizers.Tokenizer
        self.special_tokens = special_tokens  # e.g. {"eos_token": "<|im_end|>"}, as transformers' special_tokens_map
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> FastTokenizer | None:
        """The folder's tokenizer, or None when only transformers reproduces it exactly."""
        folder = Path(model_dir)
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            tokenizer_json = (folder / "tokenizer.json").read_text(encoding="utf-8")
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("tokenizer_class") not in _GENERIC_CLASSES:
            return None
        if config.get("auto_map") or (folder / "chat_template.json").exists() or (
            folder / "additional_chat_templates"
        ).exists():
            return None
        chat_template = _read_chat_template(folder, config)
        if chat_template is False:
            return None
        try:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(tokenizer_json)
        except Exception:  # a tokenizer.json this tokenizers version cannot read: transformers decides
            return None
        if config.get("clean_up_tokenization_spaces") and json.loads(tokenizer_json)["model"]["type"] != "BPE":
            return None  # transformers post-edits decoded text for WordPiece-style models
        special = _special_tokens(folder, config)
        if special is None:
            return None
        tokenizer = cls(backend, special, chat_template)
        if chat_template is not None and tokenizer._compiled_template is None:
            return None  # the template needs transformers' own Jinja extensions
        return tokenizer

    # ---- the transformers API subset -------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self.special_tokens)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs: Any):  # fmt: skip
        """The chat rendered as transformers renders it (messages, tools/documents None, special tokens)."""
        if self._compiled_template is None:
            raise ValueError("this tokenizer has no chat template")
        chat = [_alias_reasoning(m) for m in copy.deepcopy(list(messages))]
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        values = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        text = self._compiled_template.render(messages=chat, add_generation_prompt=add_generation_prompt, **values)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @cached_property
    def _compiled_template(self):
        if self.chat_template is None:
            return None
        try:
            return _jinja_environment().from_string(self.chat_template)
        except Exception:  # e.g. {% generation %}, which needs transformers' AssistantTracker extension
            return None


def _read_chat_template(folder: Path, config: dict) -> str | None | bool:
    """chat_template.jinja (transformers prefers it), else tokenizer_config's; False: a form left to transformers."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    return False  # a list of named templates


def _special_tokens(folder: Path, config: dict) -> dict[str, str] | None:
    """Named special tokens: tokenizer_config.json, then the legacy special_tokens_map.json for the rest."""
    legacy = {}
    legacy_file = folder / "special_tokens_map.json"
    if legacy_file.is_file():
        try:
            legacy = json.loads(legacy_file.read_text(encoding="utf-8"))
        except ValueError:
            return None
    special = {}
    for name in _NAMED_SPECIAL_TOKENS:
        value = config.get(name) or legacy.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            return None
        if value:
            special[name] = value
    return special


def _alias_reasoning(message):
    # transformers fills `reasoning_content` (and `thinking`) from whichever name the reasoning came under.
    if not isinstance(message, dict):
        return message
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _jinja_environment():
    """The sandbox transformers renders chat templates in: same options, filters and globals."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
