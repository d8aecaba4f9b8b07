"""LLM: the public facade. Owns the tokenizer and admission; prompts -> Requests, finished Requests -> RequestOutputs.

`add_request` is the one place a prompt is checked before the engine queues it (tokenized, not empty, shorter
than max_model_len): generate(), `nanoinfer generate`, every Ray replica and the Ray Data predictor go through it.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

from nanoinfer.chat.reasoning import (
    THINK_END,
    THINK_START,
    prompt_closes_thinking,
    prompt_opens_thinking,
    select_reasoning_parser,
)
from nanoinfer.chat.tool_calls import select_tool_call_parser
from nanoinfer.config import Config
from nanoinfer.config_file import make_config
from nanoinfer.detokenizer import StopStringChecker
from nanoinfer.engine.engine import LLMEngine, StepStats
from nanoinfer.engine.sequence import ReasoningTokens, Request
from nanoinfer.errors import (
    ConfigError,
    ConfigProblem,
    LoRAError,
    NanoInferError,
    RequestError,
    UnservableRequestError,
)
from nanoinfer.lora_request import LoRARequest
from nanoinfer.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from nanoinfer.pooling import PoolingParams, first_pooled_position, read_sentence_transformers_folder
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured_output import StructuredOutputManager
from nanoinfer.tokenizer import TEMPLATE_ARGUMENTS, load_tokenizer


class LLM:
    """Offline generation (generate, chat) or embedding (embed, with runner="pooling") over a batch of prompts.

    Args:
        model: a local Hugging Face folder, a .gguf file, the built-in default `smollm2-135m-instruct` (when
            None) or a hub id; resolved to a local folder (nanoinfer.model_source.resolve_model) before the Config.
        config: a ready Config (then keyword settings are not allowed); its model is a local folder.
        **settings: Config fields (max_model_len=..., max_num_seqs=..., dtype=..., ...). vLLM's
            `speculative_config={"method": "ngram", "num_speculative_tokens": 3, ...}` is taken too, as the
            fields num_speculative_tokens / prompt_lookup_min / prompt_lookup_max. runner="pooling" (with
            pooling_type=..., normalize=...) makes an embedding model.
    """

    def __init__(self, model: str | None = None, *, config: Config | None = None, **settings):
        if config is not None and (model is not None or settings):
            given = (["model"] if model is not None else []) + sorted(settings)
            raise NanoInferError(
                f"LLM(config=...) takes no other settings, but got {', '.join(given)}: a Config is already complete. "
                "Set them on the Config (e.g. Config(model=..., max_model_len=...)), or pass them to LLM without "
                "config."
            )
        if config is None:
            if model is not None:
                settings["model"] = model
            if "speculative_config" in settings:
                settings = _with_speculative_config(settings)
            config = make_config(settings)  # the model argument resolved to a local folder first
        self.config = config
        self.tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
        eos_ids = eos_token_ids(config.model, self.tokenizer)
        if config.eos == -1 and eos_ids:
            config.eos = min(eos_ids)  # the seed's placeholder, filled here from the tokenizer
            config.notes.append(("eos", config.eos, "from the tokenizer / generation_config.json"))
        self.eos_token_ids = eos_ids
        self.engine = LLMEngine(config, eos_token_ids=eos_ids)
        self.stop_strings = StopStringChecker(self.tokenizer)  # each request's stop strings, on its decoded text
        self._request_counter = itertools.count()
        self._structured_outputs: StructuredOutputManager | None = None  # made by the first constrained request
        # sentence-transformers 6 embeds text as a user message through the chat template, for folders it saved so
        # (Config has read the folder already: it raises nothing here)
        folder = read_sentence_transformers_folder(config.model) if config.runner == "pooling" else None
        self.embeds_messages = folder is not None and folder.renders_messages
        # A model that thinks first: how its answers split (chat/reasoning.py); callers may set another or None
        vocab, template = self.tokenizer.get_vocab(), getattr(self.tokenizer, "chat_template", None)
        self.reasoning_parser = _parser(config.reasoning_parser, lambda: select_reasoning_parser(vocab, template))
        self.tool_call_parser = _parser(config.tool_call_parser, lambda: select_tool_call_parser(vocab, template))
        # <think> and </think> as single tokens: the engine can hold a grammar back and end a thinking budget on them
        self.thinking_token_ids = (vocab[THINK_START], vocab[THINK_END]) if THINK_START in vocab \
            and THINK_END in vocab else None

    # ---- the batch API --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in the prompts' order.

        Args:
            prompts: one prompt or a list; a prompt is a string or a list of token ids.
            sampling_params: one SamplingParams for all, or one per prompt (default: SamplingParams()).
            lora_request: the LoRA adapter every prompt runs with, or one per prompt (None: the base model); an LLM
                made with enable_lora=True runs many adapters in one batch.

        Returns:
            One RequestOutput per prompt. Requests that cannot be served (an empty prompt, one longer than
            max_model_len) finish with finish_reason "error", and the others run.

        Raises:
            RequestError: a malformed prompt (token ids outside the vocabulary) or SamplingParams list, an adapter
                that cannot be used (code invalid_lora).
        """
        return self._generate(_as_prompt_list(prompts), sampling_params, lora_request, chat=False)

    def _generate(self, prompts: list, sampling_params, lora_request, chat: bool) -> list[RequestOutput]:
        """generate() and chat(): the params and adapters broadcast over the prompts, all run to the end."""
        self._check_runner("generate")
        params = _broadcast_params(sampling_params, len(prompts), SamplingParams)
        return self._run_all(prompts, params, _broadcast_loras(lora_request, len(prompts)), chat)

    def embed(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (text or token ids) with an LLM made with runner="pooling"; outputs come back in the
        prompts' order, each with `.outputs.embedding` (a list of floats).

        A prompt that cannot be served (empty, max_model_len tokens or longer) gets an output with `error` set and
        an empty embedding; the others run."""
        self._check_runner("pooling")
        prompts = _as_prompt_list(prompts)
        return self._run_all(prompts, _broadcast_params(pooling_params, len(prompts), PoolingParams))

    def _run_all(self, prompts: list, params: list, loras: list | None = None, chat: bool = False) -> list:
        # every adapter and budget before any request is queued: a refusal leaves none behind
        for lora in {id(lora): lora for lora in loras or ()}.values():
            self._check_lora(lora)
        for p in {id(p): p for p in params}.values():
            self._check_reasoning_budget(p)
        ids = []
        results: dict = {}
        for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts)):
            try:
                ids.append(self.add_request(prompt, p, lora_request=lora, chat=chat))
            except UnservableRequestError as e:
                refused = _refused_output(str(next(self._request_counter)), prompt, p, e)
                ids.append(refused.request_id)
                results[refused.request_id] = refused
        while self.has_unfinished_requests():
            for out in self.step()[0]:
                results[out.request_id] = out
        return [results[i] for i in ids]

    def _check_runner(self, runner: str) -> None:
        if self.config.runner != runner:
            what = {"generate": "generate text", "pooling": "make embeddings"}[runner]
            raise NanoInferError(f"this LLM was made with runner={self.config.runner!r}, which cannot {what}. Make "
                                 f"it with LLM(model, runner={runner!r}).")

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted by the model's chat template (with
        OpenAI `tools` and the template's own options, e.g. {"enable_thinking": False}, as vLLM's LLM.chat). The
        replies are the model's text: nanoinfer.chat.answer.chat_answer splits reasoning and tool calls off."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, tools, chat_template_kwargs)
                   for c in conversations]  # fmt: skip
        return self._generate(prompts, sampling_params, lora_request, chat=True)

    # ---- the streaming API (used by `nanoinfer generate`) ----------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, *, prompt_logprobs_start: int = 1,
                    lora_request: LoRARequest | None = None, chat: bool = False) -> str:
        """Admit one prompt: tokenize it, check that it can be served, and queue it in the engine.

        Args:
            prompt: text (tokenized here) or token ids.
            params: SamplingParams to generate (default SamplingParams()), PoolingParams to embed (an LLM with
                runner="pooling"; default PoolingParams()).
            request_id: default the next number of this LLM's counter.
            prompt_logprobs_start: with params.prompt_logprobs, the first prompt position whose logprob is wanted:
                earlier entries are None and the prefix cache may serve those tokens (scoring a continuation
                after a context other requests share computes the context once).
            lora_request: the adapter this request runs with (None: the base model); read and checked here.
            chat: the prompt is a chat template's rendering: on a model that thinks first, a structured output holds
                the answer after the thinking (a plain prompt's holds the whole output).

        Returns:
            The request id.

        Raises:
            RequestError: token ids outside the vocabulary (code out_of_vocabulary), params of the other runner
                (code wrong_runner), PoolingParams asking for more dimensions than the model has, an adapter that
                cannot be used or LoRA not enabled (code invalid_lora).
            UnservableRequestError: an empty prompt (code empty_prompt), or one of max_model_len tokens or more
                (code prompt_too_long; text too long to fit is refused before tokenizing).
        """
        if isinstance(prompt_logprobs_start, bool) or not isinstance(prompt_logprobs_start, int) \
                or prompt_logprobs_start < 0:
            raise RequestError(f"prompt_logprobs_start must be an integer >= 0, got {prompt_logprobs_start!r}",
                               code="invalid_sampling_params")
        pooling = self._pooling_params(params)
        params = SamplingParams(max_tokens=0) if pooling is not None else params or SamplingParams()
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise UnservableRequestError(
                    f"the prompt has {len(prompt):,} characters, more than max_model_len "
                    f"({self.config.max_model_len}) tokens can hold. Shorten the prompt or raise max_model_len "
                    "(--max-model-len).",
                    code="prompt_too_long",
                )
            rendered = prompt
            if pooling is not None and self.embeds_messages:
                rendered = self.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=False)
            text, token_ids = prompt, self.encode(rendered)
        else:
            text, token_ids = None, self.check_token_ids(prompt)
        self._check_length(len(token_ids))
        self._check_lora(lora_request)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        request = Request(request_id, token_ids, params, prompt=text, prompt_logprobs_start=prompt_logprobs_start,
                          pooling=pooling, lora_request=lora_request,
                          reasoning=self._reasoning_tokens(params, token_ids, chat))  # fmt: skip
        if pooling is not None:
            request.first_pooled_position = first_pooled_position(self.config.pooling_type, len(token_ids))
        if params.structured_outputs is not None:
            request.structured_output = self.structured_outputs.request_for(params.structured_outputs)
        self.engine.add_request(request)
        if params.max_tokens != 0:
            self.stop_strings.add(request)
        return request_id

    def _pooling_params(self, params) -> PoolingParams | None:
        """The request's PoolingParams on a pooling LLM (None on a generating one), checked against the runner."""
        pooling_runner = self.config.runner == "pooling"
        if params is not None and isinstance(params, PoolingParams) != pooling_runner:
            given = type(params).__name__
            raise RequestError(f"got {given}, but this LLM's runner is {self.config.runner!r}: give "
                               f"{'PoolingParams' if pooling_runner else 'SamplingParams'}, or make the LLM with "
                               f"runner={'generate' if pooling_runner else 'pooling'!r}.", code="wrong_runner")
        if not pooling_runner:
            return None
        params = params or PoolingParams()
        hidden_size = self.config.hf_config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise RequestError(f"dimensions is {params.dimensions}, but this model's embeddings have {hidden_size}. "
                               f"Ask for at most {hidden_size}, or leave it out.", code="invalid_pooling_params")
        return params

    def _reasoning_tokens(self, params: SamplingParams, token_ids: list[int], chat: bool) -> ReasoningTokens | None:
        """The thinking tokens the engine watches for a request whose budget, or a chat request whose grammar, needs
        them (None: the output is taken as it comes)."""
        if params.max_reasoning_tokens is None and not (chat and params.structured_outputs is not None):
            return None
        if self.reasoning_parser != "think" or self.thinking_token_ids is None:
            self._check_reasoning_budget(params)
            return None
        tail = self.tokenizer.decode(token_ids[-16:])
        return ReasoningTokens(*self.thinking_token_ids, opened_by_prompt=prompt_opens_thinking(tail),
                               closed_by_prompt=prompt_closes_thinking(tail))  # fmt: skip

    def _check_reasoning_budget(self, params) -> None:
        """A RequestError for a thinking budget this LLM cannot keep (a model that does not think between <think>
        tokens, or a reasoning parser set to another)."""
        if not isinstance(params, SamplingParams) or params.max_reasoning_tokens is None:
            return
        if self.reasoning_parser == "think" and self.thinking_token_ids is not None:
            return
        why = ("its reasoning parser is " + repr(self.reasoning_parser) if self.reasoning_parser is not None
               and self.thinking_token_ids is not None else "this model does not, or reasoning_parser is none")
        raise RequestError(f"max_reasoning_tokens needs a model that thinks between <think> and </think> tokens "
                           f"(Qwen3, SmolLM3, DeepSeek-R1) and reasoning_parser think; {why}. Leave it out.",
                           code="invalid_sampling_params")  # fmt: skip

    def _check_lora(self, lora: LoRARequest | None) -> None:
        """The adapter read and checked against the model (cached for the steps that run it), or a RequestError."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise RequestError(f"lora_request must be a nanoinfer.LoRARequest or None, got {type(lora).__module__}."
                               f"{type(lora).__name__}.", code="invalid_lora")  # fmt: skip
        if not self.config.enable_lora:
            raise RequestError(f"request asks for LoRA adapter {lora.lora_name!r}, but this LLM runs without LoRA. "
                               "Make it with LLM(model, enable_lora=True) (or name the adapters in `loras`).",
                               code="invalid_lora")  # fmt: skip
        try:
            self.engine.model_runner.add_lora(lora)
        except LoRAError as e:
            raise RequestError(str(e), code="invalid_lora") from None

    def _check_length(self, num_prompt_tokens: int) -> None:
        # The KV cache needs no check of its own: the engine starts only if it holds one max_model_len sequence
        # (memory.check_fits), so a prompt shorter than max_model_len can always grow to it.
        if num_prompt_tokens == 0:
            raise UnservableRequestError("the prompt is empty: give at least one token.", code="empty_prompt")
        max_model_len = self.config.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise UnservableRequestError(
                f"the prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len} (prompt plus "
                "output). Shorten the prompt or raise max_model_len (--max-model-len).",
                code="prompt_too_long",
            )

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler of this LLM's tokenizer and vocabulary."""
        if self._structured_outputs is None:
            self._structured_outputs = StructuredOutputManager(
                self.tokenizer, self.config.hf_config.vocab_size, self.eos_token_ids
            )
        return self._structured_outputs

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """One engine step; returns the requests it finished (as RequestOutputs) and its StepStats.

        The step's new tokens of sequences with stop strings are decoded then (each token once), and a sequence whose
        text now holds one finishes at the token that completed it (detokenizer.py)."""
        finished, stats = self.engine.step()
        for hit in self.stop_strings.check():
            hit.seq.output_text = hit.text
            request = self.engine.finish_on_stop_string(hit.seq, hit.num_output_tokens, hit.stop, stats)
            if request is not None:
                finished.append(request)
        return [self._to_output(r) for r in finished], stats

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    # ---- tokenizer helpers -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=not _has_bos_in_text(self.tokenizer, text))

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Longer text cannot fit max_model_len, so it is refused before tokenizing (64 MiB took ~40 s).

        No token stands for more characters than its vocabulary string has; x4 leaves room for normalizers
        that compose characters (NFC) before the model sees them.
        """
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        return 4 * longest * self.config.max_model_len

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                            chat_template_kwargs: dict | None = None) -> str:
        """The conversation rendered by the model's chat template, with OpenAI `tools` and the template's own options
        (`chat_template_kwargs`: enable_thinking and friends, as vLLM passes them)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                f"the model {self.config.model} has no chat template, so `messages` cannot be formatted. "
                "Send a plain `prompt` instead.",
                code="chat_template_error",
            )
        try:
            options = {key: value for key, value in (chat_template_kwargs or {}).items()
                       if key not in TEMPLATE_ARGUMENTS}  # the rendering's own are this call's  # fmt: skip
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools, **options
            )
        except Exception as e:  # a malformed conversation is the user's to fix
            raise RequestError(f"the chat template could not format these messages: {e}",
                               code="chat_template_error") from None

    def check_token_ids(self, token_ids: Iterable) -> list[int]:
        token_ids = list(token_ids)
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt_token_ids has {len(bad)} id(s) outside the vocabulary [0, {vocab}): {bad[:5]}. "
                "Use ids from this model's tokenizer.",
                code="out_of_vocabulary",
            )
        return token_ids

    def _to_output(self, request: Request) -> RequestOutput | EmbeddingRequestOutput:
        if request.pooling is not None:
            seq = request.sequences[0]
            return EmbeddingRequestOutput(
                request.request_id, request.prompt, list(request.prompt_token_ids),
                EmbeddingOutput(seq.embedding if seq.finish_reason != "error" else []),
                num_cached_tokens=seq.num_cached_tokens, error=seq.error, error_code=seq.error_code,
                metrics={"num_preemptions": seq.num_preemptions},
            )  # fmt: skip
        outputs = []
        for seq in request.sequences:
            if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
                text = seq.output_text
            else:
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                error=seq.error, error_code=seq.error_code,
            ))
        first = request.sequences[0]
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), outputs,
                             num_cached_tokens=first.num_cached_tokens,
                             metrics={"num_preemptions": sum(s.num_preemptions for s in request.sequences)},
                             prompt_logprobs=request.prompt_logprobs, lora_request=request.lora_request)


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (may be a list) and the tokenizer."""
    ids: set[int] = set()
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _has_bos_in_text(tokenizer, text: str) -> bool:
    # A chat-templated prompt already carries the BOS token as text; do not add a second one.
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos) and text.startswith(bos)


def _refused_output(request_id: str, prompt, params, error: RequestError):
    """What generate() (embed()) returns for a prompt add_request refused: each of its n sequences finished with the
    error (an empty embedding with the error)."""
    text, token_ids = (prompt, []) if isinstance(prompt, str) else (None, list(prompt))
    if isinstance(params, PoolingParams):
        return EmbeddingRequestOutput(request_id, text, token_ids, EmbeddingOutput([]), error=str(error),
                                      error_code=error.code)
    outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error", error=str(error),
                                error_code=error.code) for i in range(params.n)]
    return RequestOutput(request_id, text, token_ids, outputs)


def _parser(setting: str, select) -> str | None:
    """A Config parser setting resolved: auto -> `select()`, none -> None, else the name."""
    return select() if setting == "auto" else None if setting == "none" else setting


def _broadcast_loras(lora_request, n: int) -> list:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise RequestError(f"lora_request must be a LoRARequest, None, or a list of them (one a prompt), got "
                           f"{type(lora_request).__module__}.{type(lora_request).__name__}.", code="invalid_lora")
    loras = list(lora_request)
    if len(loras) != n:
        raise RequestError(f"got {len(loras)} lora_requests for {n} prompts: give one (or None) per prompt, or a "
                           "single LoRARequest for all.", code="invalid_lora")
    return loras


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _broadcast_params(params, n: int, kind: type) -> list:
    if params is None:
        return [kind()] * n
    if isinstance(params, kind):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, kind) for p in params):
        raise RequestError(f"got {len(params)} params for {n} prompts; give one {kind.__name__}, or one per prompt.")
    return params


_SPECULATIVE_FIELDS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def _with_speculative_config(settings: dict) -> dict:
    """vLLM's `speculative_config` dict (method "ngram") -> Config's flat speculation fields."""
    settings = dict(settings)
    spec = settings.pop("speculative_config")
    if spec is None:
        return settings

    def problem(message: str) -> ConfigError:
        return ConfigError([ConfigProblem("speculative_config", spec, message)])

    if not isinstance(spec, dict):
        raise problem('must be a dict, as in vLLM: {"method": "ngram", "num_speculative_tokens": 3}.')
    method = spec.get("method", "ngram")
    if method != "ngram":
        raise problem(f"method {method!r} is not supported: nanoinfer speculates with n-grams of the sequence "
                      '(vLLM\'s "ngram", prompt lookup). Use "method": "ngram", or leave speculative_config out.')
    unknown = sorted(set(spec) - {"method", *_SPECULATIVE_FIELDS})
    if unknown:
        raise problem(f"has keys nanoinfer does not know ({', '.join(unknown)}); it takes method, "
                      f"{', '.join(_SPECULATIVE_FIELDS)}. Remove the others.")
    if "num_speculative_tokens" not in spec:
        raise problem('needs "num_speculative_tokens" (how many tokens to propose a step, e.g. 3).')
    twice = sorted(name for name in _SPECULATIVE_FIELDS if name in spec and name in settings)
    if twice:
        raise problem(f"and the keyword {twice[0]} both set {twice[0]}: give it once.")
    settings.update({name: spec[name] for name in _SPECULATIVE_FIELDS if name in spec})
    return settings
