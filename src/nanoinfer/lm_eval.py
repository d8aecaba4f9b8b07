"""lm-evaluation-harness backend: `--model nanoinfer` scores and generates through the engine.

Importing this module registers the model name `nanoinfer` with lm-eval; `python -m nanoinfer.lm_eval ARGS` is
lm-eval's own command line with it registered. Tokenization, truncation and rolling windows are those of lm-eval's
`hf` backend (HFLM), so both give the same per-sample results; the engine batches, and requests that share a context
prefill it once through the prefix cache (docs/evaluation.md).
"""

from __future__ import annotations

import difflib
import itertools
import logging
import sys
import time
from collections import deque
from importlib.metadata import PackageNotFoundError, version

from nanoinfer.config import settable_fields
from nanoinfer.config_file import make_config
from nanoinfer.engine.block_manager import MIN_SHARED_TOKENS
from nanoinfer.errors import ConfigError, ConfigProblem, NanoInferError, RequestError
from nanoinfer.llm import LLM
from nanoinfer.lora.peft import adapter_rank
from nanoinfer.lora_request import lora_requests
from nanoinfer.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

try:
    import lm_eval.models  # noqa: F401  the built-in backends: get_model() only registers them into an empty registry
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:
    raise NanoInferError(
        f"nanoinfer.lm_eval needs lm-evaluation-harness, which cannot be imported ({e}). "
        "Install it with: pip install 'nanoinfer[eval]'"
    ) from None

logger = logging.getLogger("nanoinfer")

MODEL_NAME = "nanoinfer"
DEFAULT_MAX_GEN_TOKS = 256  # HFLM's and vLLM's default
PEFT_ADAPTER = "peft"  # the name `peft=` model_arg's adapter has in the engine
OWN_ARGS = ("pretrained", "max_length", "max_gen_toks", "add_bos_token", "prefix_token_id", "tokenizer", "peft")
# gen_kwargs naming the most tokens to generate, in the order lm-eval's normalize_gen_kwargs reads them.
MAX_TOKENS_KWARGS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
# gen_kwargs of a task that map onto SamplingParams fields of the same name.
SAMPLING_KWARGS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class NanoInferLM(TemplateLM):
    """lm-eval's LM on a nanoinfer engine: loglikelihood, loglikelihood_rolling, generate_until and chat templates.

    Args:
        pretrained: the model: a local Hugging Face folder, a .gguf file, a hub id; the built-in default when left out.
        max_length: most tokens in one scored window or one generation (prompt + output), as HFLM's max_length
            (default and upper bound: max_model_len - 2, since a scored window holds max_length + 1 tokens and the
            engine takes prompts shorter than max_model_len).
        max_gen_toks: most tokens generated when a task's generation_kwargs do not say (256).
        add_bos_token: as HFLM: True/False forces adding the tokenizer's special tokens; None keeps its default.
        prefix_token_id: the token an empty context is replaced by (default: BOS, else EOS, as HFLM).
        tokenizer: not supported: the engine uses the model folder's tokenizer.
        peft: a PEFT LoRA adapter folder every request runs with (HFLM's `peft`): LoRA is turned on for it, and
            max_lora_rank raised to its rank.
        batch_size, max_batch_size: ignored: the engine batches by itself (max_num_seqs, max_num_batched_tokens).
        device: lm-eval's --device: cpu, cuda or cuda:0 (without CUDA, cuda falls back to auto, as HFLM); the
            engine's `device` setting.
        **settings: every other key is a nanoinfer Config field (max_model_len, dtype, tensor_parallel_size,
            max_num_seqs, enable_prefix_caching, seed, ...); string values are parsed into the field's type.

    Raises:
        ConfigError: an unknown key (the valid ones are listed), a value of the wrong type, a max_length the engine
            cannot hold, `tokenizer`.
    """

    def __init__(self, pretrained: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, tokenizer=None, batch_size=None, max_batch_size=None,
                 device: str | None = None, peft: str | None = None, **settings):  # fmt: skip
        super().__init__()
        config = make_config(engine_settings(pretrained, device, tokenizer, settings, peft))
        self._max_length = _checked_max_length(max_length, config.max_model_len)
        self._max_gen_toks = _parse_arg("max_gen_toks", max_gen_toks, int)
        self.add_bos_token = _parse_arg("add_bos_token", add_bos_token, bool)
        self.custom_prefix_token_id = _parse_arg("prefix_token_id", prefix_token_id, int)
        self.llm = LLM(config=config)
        self.lora = lora_requests(config.loras)[PEFT_ADAPTER] if peft is not None else None
        self.tokenizer = self.llm.tokenizer
        self._bos_token_id = _bos_token_id(self.tokenizer)
        self._prefix_text = self.tokenizer.decode([self.prefix_token_id])  # HFLM's has_bos_prefix reads it
        self._request_ids = (f"lm-eval-{i}" for i in itertools.count())
        self._warned_gen_kwargs: set[str] = set()
        self._quiet = False  # loglikelihood's disable_tqdm, for the windows TemplateLM passes on
        # The last loglikelihood call's prompt tokens: what was sent and what the engine computed (the rest came
        # from the prefix cache). Tests and benchmarks/lm_eval_mc.py read it.
        self.last_token_counts = {"requests": 0, "submitted": 0, "computed": 0}

    # ---- what lm-eval asks of a TemplateLM --------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self._bos_token_id if self._bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        name = getattr(self.tokenizer, "name_or_path", None) or self.llm.config.model
        return str(name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:  # fmt: skip
        """HFLM.tok_encode: no second BOS when the text starts with the prefix token's text (a chat template's)."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and string.startswith(self._prefix_text):
            special = False
        if special is None:
            token_ids = self.tokenizer.encode(string)
        else:
            token_ids = self.tokenizer.encode(string, add_special_tokens=special)
        return token_ids[-left_truncate_len:] if left_truncate_len else token_ids

    def _encode_context(self, string: str) -> list[int]:
        """A generation context as HFLM.tok_batch_encode encodes it (its BOS rule differs from tok_encode's)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos and string.startswith(bos):
            return self.tokenizer.encode(string, add_special_tokens=False)
        if self.add_bos_token is not None:
            return self.tokenizer.encode(string, add_special_tokens=self.add_bos_token)
        return self.tokenizer.encode(string)

    def get_model_info(self) -> dict:
        return {"model_path": self.llm.config.model, "model_dtype": self.llm.config.dtype,
                "max_model_len": self.llm.config.max_model_len, "nanoinfer_version": _nanoinfer_version()}

    # ---- loglikelihood ------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding gives the continuation) per request.

        TemplateLM tokenizes as HFLM does: trailing spaces of the context move to the continuation, an empty
        context becomes the prefix token. Its tqdm bar is turned off; progress goes to the `nanoinfer` logger.
        """
        self._quiet = disable_tqdm
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation) or None, context ids, continuation ids) -> (logprob, is_greedy) each."""
        windows = [self._scoring_window(context_enc, continuation_enc) for _, context_enc, continuation_enc in requests]
        quiet = disable_tqdm or self._quiet
        results = self._score(windows, "loglikelihood", quiet)
        for (cache_key, _, _), result in zip(requests, results):
            if cache_key is not None:  # rolling windows have none: loglikelihood_rolling caches per string
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def _scoring_window(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[list[int], int]:
        """(prompt, first scored position): HFLM's left truncation to max_length + 1 tokens, continuation whole."""
        if len(continuation_enc) > self.max_length:
            raise RequestError(
                f"a continuation of {len(continuation_enc)} tokens is longer than max_length ({self.max_length}), "
                "so it cannot be scored (lm-eval's hf backend refuses it too). Raise max_length in --model_args "
                "(and max_model_len to at least max_length + 2).",
                code="prompt_too_long",
            )
        tokens = (context_enc + continuation_enc)[-(self.max_length + 1):]
        return tokens, len(tokens) - len(continuation_enc)

    def _score(self, windows: list[tuple[list[int], int]], what: str, quiet: bool) -> list[tuple[float, bool]]:
        """Score windows[i] = (prompt, start): the sum of the logprobs of prompt[start:] and whether each is top-1.

        Windows sharing a context prompt[:start] form a group. Its context goes in first, alone, scoring nothing
        (the "leader"); the windows follow once it has finished, so that the engine's prefix cache serves them the
        context, whole blocks and the partly filled last one (_Submitter says in what order). A leader ending with
        the context, not with a continuation, leaves its last block shareable however close the context ends to a
        block boundary. Results come back in the order of `windows`.
        """
        results: list[tuple[float, bool] | None] = [None] * len(windows)
        contexts: dict[tuple[int, ...], list[int]] = {}
        for i, (tokens, start) in enumerate(windows):
            if start == len(tokens):  # an empty continuation: log 1 = 0, and greedy trivially
                results[i] = (0.0, True)
            else:
                contexts.setdefault(tuple(tokens[:start]), []).append(i)
        entries, groups = list(windows), []
        for context in sorted(contexts):
            members = contexts[context]
            # Nothing to wait for without the prefix cache, or for contexts shorter than the least it shares.
            if not self.llm.config.enable_prefix_caching or len(context) < MIN_SHARED_TOKENS:
                groups += [[i] for i in members]
                continue
            if len(members) > 1:
                entries.append((list(context), len(context)))  # scores nothing: all its prompt_logprobs are None
                members = [len(entries) - 1, *members]
            groups.append(members)
        submitter = _Submitter(entries, groups, self.llm.config, self.llm.engine.block_manager.num_blocks)
        params = SamplingParams(max_tokens=0, prompt_logprobs=1)
        in_flight: dict[str, int] = {}  # request id -> window index
        num_submitted = num_computed = 0
        progress = _Progress(what, len(windows), quiet)
        while True:
            for i in submitter.take():
                tokens, start = entries[i]
                request_id = self.llm.add_request(tokens, params, next(self._request_ids), prompt_logprobs_start=start,
                                                  lora_request=self.lora)  # fmt: skip
                in_flight[request_id] = i
            if not in_flight:
                break
            for output in self.llm.step()[0]:
                i = in_flight.pop(output.request_id)
                if output.error is not None:
                    raise NanoInferError(f"the engine could not score a request: {output.error}")
                tokens, start = entries[i]
                num_computed += len(tokens) - output.num_cached_tokens  # a leader's context counts here only
                if i < len(windows):
                    results[i] = _sum_logprobs(output.prompt_logprobs, tokens, start)
                    num_submitted += len(tokens)
                    progress.update()
                submitter.finished(i)
        self.last_token_counts = {"requests": len(windows), "submitted": num_submitted, "computed": num_computed}
        logger.info(
            "%s: %d requests, %d prompt tokens submitted, %d computed (%.1f%% served by the prefix cache)",
            what, len(windows), num_submitted, num_computed,
            100.0 * (num_submitted - num_computed) / max(num_submitted, 1),
        )  # fmt: skip
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's loglikelihood in HFLM's disjoint windows of max_length tokens, the prefix token first."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            token_windows = lm_eval_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            for context, continuation in map(lm_eval_utils.make_disjoint_window, token_windows):
                windows.append(self._scoring_window(context, continuation))
                owners.append(index)
        scores = self._score(windows, "loglikelihood_rolling", disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ---------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate for every (context, gen_kwargs) in one engine batch; the text is cut at the first `until`.

        As HFLM: the context is left-truncated to max_length - max_gen_toks tokens, EOS's text joins `until`, greedy
        unless do_sample (then temperature, top_p, top_k, ... as given).
        """
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        untils, submitted = [], {}
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            params, until = self._sampling_params(gen_kwargs, eos)
            max_context_len = self.max_length - params.max_tokens
            if max_context_len <= 0:
                raise RequestError(
                    f"max_gen_toks ({params.max_tokens}) leaves no room for the context in max_length "
                    f"({self.max_length}). Lower max_gen_toks or raise max_length (and max_model_len).",
                    code="prompt_too_long",
                )
            # An empty context has nothing to condition on: the prefix token stands in, as for loglikelihood.
            token_ids = self._encode_context(context)[-max_context_len:] or [self.prefix_token_id]
            submitted[self.llm.add_request(token_ids, params, next(self._request_ids), lora_request=self.lora)] = index
            untils.append(until)
        texts: list[str] = [""] * len(requests)
        progress = _Progress("generate_until", len(requests), disable_tqdm)
        while submitted:
            for output in self.llm.step()[0]:
                index = submitted.pop(output.request_id)
                if output.error is not None:
                    raise NanoInferError(f"the engine could not serve a generation request: {output.error}")
                texts[index] = _cut_at_stop(output.outputs[0].text, untils[index])
                progress.update()
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _sampling_params(self, gen_kwargs: dict, eos: str) -> tuple[SamplingParams, list[str]]:
        """A task's generation_kwargs -> (SamplingParams, the `until` strings) as lm-eval's normalize_gen_kwargs."""
        if not isinstance(gen_kwargs, dict):
            raise RequestError(f"generation kwargs must be a dict, got {gen_kwargs!r}")
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        if eos and eos not in until:
            until.append(eos)
        given = [kwargs.pop(key, None) for key in MAX_TOKENS_KWARGS]
        max_tokens = next((value for value in given if value is not None), None)  # the first alias given
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        do_sample = kwargs.pop("do_sample", None)
        if do_sample is None:
            do_sample = temperature > 0.0
        values = {key: kwargs.pop(key) for key in SAMPLING_KWARGS if kwargs.get(key) is not None}
        for key in kwargs:
            if key not in self._warned_gen_kwargs:
                self._warned_gen_kwargs.add(key)
                logger.warning("generation kwarg %r is not supported by nanoinfer and is ignored", key)
        # The engine takes at most MAX_STOP_STRINGS stop strings; _cut_at_stop applies them all to the text.
        stop = [s for s in until if s and len(s) <= MAX_STOP_STRING_CHARS][:MAX_STOP_STRINGS]
        params = SamplingParams(
            temperature=temperature if do_sample else 0.0,
            max_tokens=int(max_tokens if max_tokens is not None else self.max_gen_toks),
            stop=stop, **values,
        )  # fmt: skip
        return params, until

    # ---- chat templates -----------------------------------------------------------------------------------
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text through the model's chat template (HFLM's behaviour).

        add_generation_prompt=False continues the last (assistant) message instead, as transformers'
        continue_final_message. A template that refuses the system message gets the conversation without it.
        """
        try:
            text = self.llm.apply_chat_template(chat_history, add_generation_prompt)
        except RequestError:
            if not any(m.get("role") == "system" for m in chat_history):
                raise
            logger.warning("Failed to apply the chat template; removing the system message from the chat history.")
            chat_history = [m for m in chat_history if m.get("role") != "system"]
            text = self.llm.apply_chat_template(chat_history, add_generation_prompt)
        if add_generation_prompt or not chat_history:
            return text
        return _continue_final_message(text, chat_history[-1]["content"])


def engine_settings(pretrained, device, tokenizer, settings: dict, peft: str | None = None) -> dict:
    """model_args (other than this backend's own) -> Config fields, each value parsed into its field's type; `peft`
    becomes the one adapter in `loras`, max_lora_rank at least its rank."""
    problems = []
    if tokenizer is not None:
        problems.append(ConfigProblem("tokenizer", tokenizer, "is not supported: nanoinfer uses the model folder's "
                                      "tokenizer. Remove it from --model_args."))
    valid = settable_fields()
    unknown = [key for key in settings if key not in valid]
    if unknown:
        problems.append(_unknown_args_problem(unknown, valid))
    if problems:
        raise ConfigError(problems)
    values = {key: _parse_field(key, value) for key, value in settings.items()}
    if values.get("runner", "generate") != "generate":
        raise ConfigError([ConfigProblem("runner", values["runner"], "must be generate: lm-eval scores and generates "
                                         "text. Remove runner from --model_args.")])
    if pretrained is not None:
        if "model" in values:
            raise ConfigError([ConfigProblem("model", values["model"], "is given twice, as model and as pretrained. "
                                             "Keep pretrained.")])
        values["model"] = str(pretrained)
    if device is not None:
        values["device"] = _engine_device(str(device))
    if peft is not None:
        values["loras"] = {PEFT_ADAPTER: str(peft)}
        rank = adapter_rank(str(peft))
        if rank is not None and "max_lora_rank" not in values:
            values["max_lora_rank"] = max(rank, 1)
    return values


def _unknown_args_problem(unknown: list[str], valid: list[str]) -> ConfigProblem:
    names = []
    for key in unknown:
        match = difflib.get_close_matches(key, [*OWN_ARGS, *valid], n=1, cutoff=0.6)
        names.append(f"{key} (did you mean {match[0]}?)" if match else key)
    own = [key for key in OWN_ARGS if key != "tokenizer"]
    return ConfigProblem(
        "", None,
        f"unknown --model_args key(s) {', '.join(names)} for --model {MODEL_NAME}. Valid keys: "
        f"{', '.join(own)} and the engine settings {', '.join(k for k in valid if k != 'model')}.",
    )  # fmt: skip


def _parse_field(name: str, value):
    """A model_args value in the Config field's type ("64" -> 64, "true" -> True); Config reports what is left."""
    from nanoinfer.config import Config

    kind = Config.__dataclass_fields__[name].type  # a string: `from __future__ import annotations`
    kind = kind.removesuffix(" | None")  # "None" itself reads as None already (lm-eval's parser)
    return _parse_arg(name, value, {"int": int, "float": float, "bool": bool, "str": str}.get(kind), report=False)


def _parse_arg(name: str, value, kind, report: bool = True):
    """`value` as `kind` (int, float, bool, str) when it reads as one; else a ConfigProblem, or as is for Config."""
    if value is None or kind is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return value
    parsed = None
    if isinstance(value, str):
        text = value.strip()
        if kind is bool:
            parsed = True if text.lower() in _TRUE else False if text.lower() in _FALSE else None
        elif kind in (int, float):
            try:
                parsed = kind(text)
            except ValueError:
                parsed = None
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        parsed = float(value)
    elif kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        parsed = str(value)  # lm-eval reads `model=123` as a number
    if parsed is not None:
        return parsed
    if not report:
        return value
    expected = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]
    raise ConfigError([ConfigProblem(name, value, f"expected {expected}. Fix it in --model_args.")])


def _engine_device(device: str) -> str:
    """lm-eval's --device (its CLI passes cuda:0 unless told) -> Config.device; unusable CUDA falls back to auto."""
    name = device.strip().lower()
    if name in ("cpu", "auto"):
        return name
    if name in ("cuda", "cuda:0"):
        import torch

        if torch.cuda.is_available():
            return "cuda"
        logger.info("device %s is not available here; the engine picks its device (auto), as lm-eval's hf does", device)
        return "auto"
    raise ConfigError([ConfigProblem(
        "device", device, "must be cpu, cuda or cuda:0. To use another GPU, select it with CUDA_VISIBLE_DEVICES; "
        "for several, use tensor_parallel_size in --model_args.")])


def _checked_max_length(max_length, max_model_len: int) -> int:
    # A scored window is max_length + 1 tokens (HFLM feeds max_length and scores the token after), and the engine
    # takes prompts shorter than max_model_len: hence max_model_len - 2.
    longest = max_model_len - 2
    if max_length is None:
        return longest
    max_length = _parse_arg("max_length", max_length, int)
    if not 1 <= max_length <= longest:
        raise ConfigError([ConfigProblem(
            "max_length", max_length,
            f"must be between 1 and max_model_len - 2 = {longest}: a scored window holds max_length + 1 tokens, and "
            f"the engine takes prompts shorter than max_model_len ({max_model_len}). Lower max_length, or raise "
            f"max_model_len to {max(max_length, 1) + 2} in --model_args.")])
    return max_length


def _bos_token_id(tokenizer) -> int | None:
    if hasattr(tokenizer, "bos_token_id"):
        return tokenizer.bos_token_id
    bos = getattr(tokenizer, "bos_token", None)  # nanoinfer's FastTokenizer names the token only
    return None if bos is None else tokenizer.get_vocab().get(bos)


def _sum_logprobs(prompt_logprobs, tokens: list[int], start: int) -> tuple[float, bool]:
    total, is_greedy = 0.0, True
    for position in range(start, len(tokens)):
        entry = prompt_logprobs[position]
        total += entry.logprob
        is_greedy = is_greedy and entry.top[0][0] == tokens[position]
    return total, is_greedy


def _cut_at_stop(text: str, until: list[str]) -> str:
    """The text before the first stop string, as lm-eval's postprocess_generated_text."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def _continue_final_message(rendered: str, final_message: str) -> str:
    """transformers' continue_final_message: the rendered chat cut right after the last message's content."""
    if final_message.strip() not in rendered:
        raise RequestError("the chat template does not render the last message's text, so it cannot be continued "
                           "(an assistant prefix, gen_prefix). Use a task without one.", code="chat_template_error")
    location = rendered.rindex(final_message.strip())
    if rendered[location:location + len(final_message.lstrip())] == final_message:
        return rendered[: location + len(final_message.lstrip())]
    return rendered[: location + len(final_message.strip())]  # the template trimmed trailing spaces


def _nanoinfer_version() -> str | None:
    try:
        return version("nanoinfer")
    except PackageNotFoundError:
        return None


class _Submitter:
    """Which scoring requests to hand the engine next, so that what requests share is computed once.

    Groups (window indices sharing a context, the first its leader) come sorted by context; consecutive groups whose
    contexts share MIN_SHARED_TOKENS or more tokens (few-shot examples, a task's preamble) form a family. A family's
    first leader goes alone; when it finishes, the family's other leaders follow (the shared start is then cached),
    and a group's followers follow its leader. Ready requests go before any new family, while what they share is the
    newest in the prefix cache. What is in flight is kept to about one engine step (max_num_seqs requests,
    max_num_batched_tokens tokens it will compute), so nothing waits in the engine's queue behind newer requests,
    and to half the KV cache's blocks, a leader counted with its followers' blocks: the finished leaders' blocks then
    stay cached until their followers have them.
    """

    def __init__(self, windows: list[tuple[list[int], int]], groups: list[list[int]], config, num_blocks: int):
        self.windows = windows
        # families not started (without the prefix cache nothing is shared: every group on its own)
        self.pending = deque(_families(windows, groups) if config.enable_prefix_caching else [[g] for g in groups])
        self.ready: deque[int] = deque()  # requests whose leader has finished
        self.followers = {group[0]: group[1:] for group in groups if len(group) > 1}  # a leader -> the rest
        self.next_leaders: dict[int, list[int]] = {}  # a family's first leader -> the family's other leaders
        self.leaders = {group[0] for group in groups}
        self.in_flight_tokens: dict[int, int] = {}  # window index -> tokens it will compute (an estimate)
        self.num_in_flight_tokens = 0
        self.max_num_seqs, self.max_tokens = config.max_num_seqs, config.max_num_batched_tokens
        # At most half the KV cache's blocks held by what is in flight: the other half keeps the finished leaders'
        # blocks until their followers have copied them (each request holds a block at least, however short).
        self.block_size, self.max_blocks = config.kvcache_block_size, max(num_blocks // 2, 1)
        self.in_flight_blocks: dict[int, int] = {}
        self.num_in_flight_blocks = 0

    def take(self) -> list[int]:
        """Window indices to submit now, in order."""
        taken = []
        while self.ready or self.pending:
            if self.ready:
                index = self.ready[0]
                tokens, start = self.windows[index]
                # A follower computes its continuation and the context's last token; a leader, at most all of it.
                if not self._take(index, len(tokens) if index in self.leaders else len(tokens) - start + 1,
                                  self._group_blocks(index)):
                    break
                self.ready.popleft()
                taken.append(index)
                continue
            family = self.pending[0]
            head = family[0][0]
            if not self._take(head, len(self.windows[head][0]), self._group_blocks(head)):
                break
            self.pending.popleft()
            self.next_leaders[head] = [group[0] for group in family[1:]]
            taken.append(head)
        return taken

    def finished(self, index: int) -> None:
        self.num_in_flight_tokens -= self.in_flight_tokens.pop(index)
        self.num_in_flight_blocks -= self.in_flight_blocks.pop(index)
        self.ready.extend(self.followers.pop(index, ()))
        self.ready.extend(self.next_leaders.pop(index, ()))

    def _group_blocks(self, index: int) -> int:
        """The blocks `index` holds, and for a leader those its followers will (they come as it finishes: its
        blocks must still be cached then)."""
        return sum(-(-len(self.windows[i][0]) // self.block_size) for i in [index, *self.followers.get(index, ())])

    def _take(self, index: int, cost: int, blocks: int) -> bool:
        """Count `index` in flight if there is room: about one engine step's requests and computed tokens, and half
        the KV cache's blocks."""
        if self.in_flight_tokens and (len(self.in_flight_tokens) >= self.max_num_seqs
                                      or self.num_in_flight_tokens + cost > self.max_tokens
                                      or self.num_in_flight_blocks + blocks > self.max_blocks):
            return False
        self.in_flight_tokens[index] = cost
        self.num_in_flight_tokens += cost
        self.in_flight_blocks[index] = blocks
        self.num_in_flight_blocks += blocks
        return True


def _families(windows: list[tuple[list[int], int]], groups: list[list[int]]) -> list[list[list[int]]]:
    """Consecutive groups whose contexts share MIN_SHARED_TOKENS or more leading tokens, together."""
    families: list[list[list[int]]] = []
    previous: list[int] = []
    for group in groups:
        tokens, start = windows[group[0]]
        context = tokens[:start]
        shared = next((i for i, (a, b) in enumerate(zip(previous, context)) if a != b), min(len(previous), start))
        if families and shared >= MIN_SHARED_TOKENS:
            families[-1].append(group)
        else:
            families.append([group])
        previous = context
    return families


class _Progress:
    """A log line every 30 s while requests finish (lm-eval's tqdm bars are not used)."""

    INTERVAL_S = 30.0

    def __init__(self, what: str, total: int, quiet: bool):
        self.what, self.total, self.quiet = what, total, quiet
        self.done, self.start = 0, time.perf_counter()
        self.last = self.start

    def update(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if not self.quiet and now - self.last >= self.INTERVAL_S:
            self.last = now
            logger.info("%s: %d/%d requests (%.0f s)", self.what, self.done, self.total, now - self.start)


def main(argv: list[str] | None = None) -> None:
    """`python -m nanoinfer.lm_eval ...`: lm-eval's command line, with `--model nanoinfer` registered.

    A NanoInferError (a bad model_arg, a model that cannot load) is printed without a traceback; exit code 2.
    """
    from lm_eval.__main__ import cli_evaluate

    # lm-eval's CLI shows only its own logger; ours says what the prefix cache saved. For this run only.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s [nanoinfer] %(message)s",
                                           datefmt="%Y-%m-%d:%H:%M:%S"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except NanoInferError as e:
        print(f"Error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


if __name__ == "__main__":
    # Run as a script this file is `__main__`; the model is registered by the importable module, once.
    from nanoinfer.lm_eval import main as _main

    _main()
else:
    register_model(MODEL_NAME)(NanoInferLM)
