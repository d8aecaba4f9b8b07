"""Config: the seed's dataclass (nano-vllm's config.py) plus the fields nanoinfer needs.

Every user-facing settings check lives here and reports all problems at once (ConfigError). The seed's
placeholders (hf_config, max_model_len clamping, device/dtype/attention "auto") are filled in by
`__post_init__`, and each change is recorded in `notes` so `check-config` can show what was filled in and
from where. Config reads a local model folder and fetches nothing: turning a model argument (the default's
name, a .gguf file, a hub id) into that folder is `nanoinfer.model_source.resolve_model`'s step, taken before
a Config is built (`nanoinfer.config_file.make_config`, used by LLM and every CLI command, which also merges
YAML files and flags).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoinfer.chat.reasoning import REASONING_PARSERS
from nanoinfer.chat.tool_calls import TOOL_CALL_PARSERS
from nanoinfer.errors import ConfigError, ConfigProblem
from nanoinfer.models import registry
from nanoinfer.models.config import load_hf_config
from nanoinfer.pooling import POOLING_TYPES, read_sentence_transformers_folder

DEFAULT_MODEL = "smollm2-135m-instruct"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
CPU_KERNELS = ("auto", "wait", "off")
RUNNERS = ("generate", "pooling")
# Fields that are not user settings: filled in by __post_init__ (or, for eos, by the engine).
NOT_SETTABLE = {
    "hf_config": "it is loaded from the model folder's config.json; point `model` at the folder instead",
    "model_spec": "it is derived from the model's config.json; point `model` at the folder instead",
    "notes": "it records what nanoinfer filled in or clamped; it is output, not a setting",
    "eos": "the end-of-sequence id comes from the model's tokenizer; set stop conditions per request instead",
}


@dataclass(slots=True)
class Config:
    """Engine settings. Field names and defaults of the first eleven are the seed's (nano-vllm).

    Args:
        model: a local model folder holding a config.json: a Hugging Face snapshot, or the folder
            `nanoinfer.model_source.resolve_model` makes for the built-in default `smollm2-135m-instruct`, a .gguf
            file or a hub repo id (LLM(...), `config_file.make_config` and every CLI command resolve those first).
            A relative path is resolved against the current working directory (also when it comes from a
            YAML file), as vLLM and transformers do; `model` then holds the absolute path.
        max_num_batched_tokens: most tokens in one forward pass, summed over the scheduled sequences;
            must be >= max_num_seqs.
        max_num_seqs: most sequences in one forward pass.
        max_model_len: most tokens (prompt + output) in one sequence; clamped to max_position_embeddings.
        gpu_memory_utilization: fraction of device memory the engine may use in all (CUDA), in (0, 1].
        tensor_parallel_size: processes the weights are sharded over (1..8); must divide the model's
            attention heads and key/value heads.
        enforce_eager: True disables CUDA graphs for decode.
        hf_config: loaded from `model/config.json`; never passed by hand (a value passed in is replaced).
        eos: placeholder; filled from the tokenizer by the engine.
        kvcache_block_size: tokens per KV-cache block, a positive multiple of 256.
        num_kvcache_blocks: total KV blocks; -1 sizes the cache from memory. A set value must hold one
            max_model_len sequence: num_kvcache_blocks * kvcache_block_size >= max_model_len.
        device: auto | cpu | cuda (auto: cuda when available, else cpu).
        dtype: auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA, float16 on GPUs without
            bfloat16, float32 on CPU). float16 is refused on CPU.
        kv_cache_dtype: auto | float32 | bfloat16 | float16 | fp8 | fp8_e4m3 | fp8_e5m2: what the KV cache
            stores (vLLM's field). auto is the model's dtype; bfloat16 under a float32 model halves the
            cache (twice the tokens in the same memory, less to read per decode step) at the price of
            exact agreement with transformers, fp8 quarters it (fp8 = fp8_e4m3; scale 1, saturating at
            the largest finite value, as vLLM without calibrated scales). Keys and values are rounded
            once, when stored; attention still computes in float32 (on CUDA: in the model's dtype). float16 is
            refused on CPU, fp8_e4m3 on CUDA GPUs older than compute capability 8.9 (the Triton kernels');
            flash-attn needs it equal to dtype.
        attention_backend: auto | torch | triton | flash-attn. triton and flash-attn need CUDA; flash-attn
            needs the flash-attn package and float16/bfloat16. auto picks flash-attn, then triton, then torch.
        seed: global seed for sampling when a request gives none.
        cpu_kvcache_space_gib: KV-cache memory budget on CPU, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); > 0.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        num_threads: torch intra-op threads on CPU; 0 means one per physical core.
        cpu_kernels: auto | wait | off: whether a CPU engine uses nanoinfer's compiled C++ kernels (several times
            faster than plain torch; built once per machine, about 2 minutes). auto: use them when already built
            here, else start building them in the background for the next run and serve this run on plain torch;
            wait: build them now if needed and use them; off: plain torch. `nanoinfer generate` waits for a large
            job (16,384 or more output tokens at its max_tokens) and `bench` always waits, unless this is set.
            NANOINFER_DISABLE_CPU_KERNELS=1 in the environment means off. Ignored on CUDA.
        trust_remote_code: never turned on by nanoinfer itself; passed to transformers when loading
            config.json (and the tokenizer). Only set it for a model folder you trust.
        num_speculative_tokens: n-gram speculative decoding (vLLM's `ngram` method, prompt lookup): up to
            this many tokens proposed per greedy sequence per step, from the continuation of the latest
            earlier occurrence of its last tokens, and verified by the model in the same step. 0 (the
            default) turns it off. Greedy output is unchanged; sampled requests (and those asking for
            logprobs or penalties) are never speculated. 0..16.
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths matched, longest first (1 <= min <= max <= 8).
        runner: generate | pooling (vLLM's): pooling makes embeddings (LLM.embed, `nanoinfer embed`) instead of text.
        pooling_type: last | mean | cls: how the pooling runner turns a prompt's final hidden states into one
            vector. None: the model folder's sentence-transformers config (modules.json, 1_Pooling/config.json),
            else last (the token that has seen the whole prompt, as decoder embedding models pool).
        normalize: L2-normalize embeddings. None: whether the sentence-transformers folder has a Normalize module,
            else True.
        enable_lora: run PEFT LoRA adapters, a different one per request if asked, many in one batch (vLLM's).
            Filled in true when `loras` names any.
        max_loras: most adapters one step runs (each a slot of A and B weights in every adapted layer). 0: as many as
            `loras` names, at least 1 and at most 8.
        max_lora_rank: the largest adapter rank accepted (1..512); every slot is this wide.
        max_cpu_loras: most adapters kept read in host memory (least recently used dropped). 0: max_loras or the
            number `loras` names, the larger; at least max_loras.
        loras: adapter name -> PEFT folder, for `generate` jobs (a line's "lora", an OpenAI line's `body.model`);
            each folder is checked against the model (rank, targets, shapes) with the rest of the config.
        reasoning_parser: auto | none | think | harmony: how chat answers split into reasoning_content and content
            (auto: from the tokenizer's tokens and chat template; think: <think>...</think>, harmony: gpt-oss).
        tool_call_parser: auto | none | hermes | llama3_json | mistral | harmony: how chat answers' tool calls are
            read (auto: from the tokenizer and chat template; harmony: gpt-oss's to=functions.NAME messages).

    Raises:
        ConfigError: listing every invalid field at once (field, value, rule and fix).
    """

    model: str = DEFAULT_MODEL
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    hf_config: Any = None
    model_spec: Any = None  # the model family's ModelSpec (models/spec.py), derived from hf_config
    eos: int = -1
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    # nanoinfer's own fields
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    cpu_kvcache_space_gib: float = 4.0
    enable_prefix_caching: bool = True
    num_threads: int = 0
    cpu_kernels: str = "auto"
    trust_remote_code: bool = False
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    runner: str = "generate"
    pooling_type: str | None = None
    normalize: bool | None = None
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    loras: dict = field(default_factory=dict)
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    # What __post_init__ filled in or clamped: (field, value, reason). Not a user setting; init=False so
    # dataclasses.replace() starts a fresh list instead of copying the old notes.
    notes: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        problems = [p for name in user_fields() if (p := type_problem(name, getattr(self, name)))]
        bad = {p.field for p in problems}  # fields with the wrong type: skip every rule that reads them
        problems += _range_problems(self, bad)
        if "model" not in bad and self.model.strip():
            problems += self._load_model_config(bad)
        problems += self._resolve_device(bad)
        if not problems and self.device == "cpu" and self.model_spec is not None:
            problems += _cpu_weights_problem(self)
        if problems:
            raise ConfigError(problems)
        self.gpu_memory_utilization = float(self.gpu_memory_utilization)  # YAML `1` is a valid fraction
        self.cpu_kvcache_space_gib = float(self.cpu_kvcache_space_gib)

    def _load_model_config(self, bad: set[str]) -> list[ConfigProblem]:
        """Load the model folder's config.json, clamp max_model_len; model-dependent checks."""
        model_dir = Path(self.model).expanduser()
        if not (model_dir / "config.json").is_file():
            return [_not_a_model_folder(self.model, model_dir)]  # the checks below need the model: skip them
        model_dir = model_dir.resolve()
        if str(model_dir) != self.model:
            self.notes.append(("model", str(model_dir), f"resolved from {self.model!r}"))
        self.model = str(model_dir)
        trust = self.trust_remote_code if "trust_remote_code" not in bad else False
        try:
            self.hf_config = load_hf_config(self.model, trust_remote_code=trust)
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [
                ConfigProblem(
                    "model",
                    self.model,
                    f"its config.json cannot be read by transformers ({e}). Point `model` at a Hugging Face "
                    "model folder whose config.json is valid.",
                )
            ]
        self.hf_config, notice = registry.text_config(self.hf_config)  # a vision-language checkpoint's text part
        if notice:
            self.notes.append(("model", self.model, notice))
        if registry.is_base_checkpoint(self.hf_config):
            # No LM head to load: the head shares the embedding table, so the family builds (embeddings never read it)
            if dataclasses.is_dataclass(self.hf_config):  # our frozen view of config.json
                self.hf_config = dataclasses.replace(self.hf_config, tie_word_embeddings=True)
            else:
                self.hf_config.tie_word_embeddings = True
            self.notes.append(("model", self.model, f"a base model ({self.hf_config.architectures[0]}) without an LM "
                               "head: it makes embeddings (runner: pooling)"))  # fmt: skip
        max_pos = getattr(self.hf_config, "max_position_embeddings", None)
        if "max_model_len" not in bad and isinstance(max_pos, int) and self.max_model_len > max_pos:
            reason = f"clamped from {self.max_model_len} to the model's max_position_embeddings"
            self.notes.append(("max_model_len", max_pos, reason))
            self.max_model_len = max_pos
        return (_model_problems(self, bad) + _kvcache_capacity_problem(self, bad) + _hybrid_model_problems(self, bad)
                + _pooling_problems(self, bad) + _lora_problems(self, bad))

    def _resolve_device(self, bad: set[str]) -> list[ConfigProblem]:
        """Fill in device/dtype/attention_backend 'auto' and check they work together on this machine."""
        problems = []
        device_ok = "device" not in bad and self.device in DEVICES
        if "device" not in bad and not device_ok:
            problems.append(_choice_problem("device", self.device, DEVICES))
        if device_ok and self.device != "cpu":
            import torch  # only needed to look at the hardware

            cuda = torch.cuda.is_available()
            if self.device == "auto":
                self.device = "cuda" if cuda else "cpu"
                self.notes.append(
                    ("device", self.device, "auto: " + ("CUDA is available" if cuda else "no CUDA"))
                )
            elif not cuda:
                problems.append(
                    ConfigProblem(
                        "device",
                        "cuda",
                        f"CUDA is not available here (torch {torch.__version__}, "
                        f"CUDA build {torch.version.cuda or 'none'}). Use device: cpu, or device: auto.",
                    )
                )
                device_ok = False
            if device_ok and self.device == "cuda" and "tensor_parallel_size" not in bad:
                num_gpus = torch.cuda.device_count()
                if self.tensor_parallel_size > num_gpus:
                    problems.append(
                        ConfigProblem(
                            "tensor_parallel_size",
                            self.tensor_parallel_size,
                            f"needs one GPU per rank but {num_gpus} are visible. "
                            f"Set tensor_parallel_size to at most {num_gpus}.",
                        )
                    )
        problems += self._resolve_dtype(device_ok, bad)
        problems += self._resolve_kv_cache_dtype(device_ok, bad)
        problems += self._resolve_attention_backend(device_ok, bad)
        return problems

    def _resolve_dtype(self, device_ok: bool, bad: set[str]) -> list[ConfigProblem]:
        if "dtype" in bad:
            return []
        if self.dtype not in DTYPES:
            return [_choice_problem("dtype", self.dtype, DTYPES)]
        if not device_ok:
            return []
        if self.dtype == "auto":
            if self.device == "cpu":
                self.dtype = "float32"
            else:
                import torch

                self.dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            self.notes.append(("dtype", self.dtype, f"auto for {self.device}"))
        elif self.dtype == "float16" and self.device == "cpu":
            return [
                ConfigProblem(
                    "dtype",
                    "float16",
                    "is not usable on the CPU (many CPU kernels lack float16 or run it very slowly). "
                    "Use bfloat16 or float32.",
                )
            ]
        elif self.dtype == "bfloat16" and self.device == "cuda":
            import torch

            if not torch.cuda.is_bf16_supported():
                return [
                    ConfigProblem(
                        "dtype", "bfloat16", "this GPU has no bfloat16 support. Use float16 or float32."
                    )
                ]
        return []

    def _resolve_kv_cache_dtype(self, device_ok: bool, bad: set[str]) -> list[ConfigProblem]:
        if "kv_cache_dtype" in bad:
            return []
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            return [_choice_problem("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)]
        if not device_ok or "dtype" in bad or self.dtype not in DTYPES or self.dtype == "auto":
            return []  # the dtype's own problem is reported; auto stays until it resolves
        if self.kv_cache_dtype == "auto":
            self.kv_cache_dtype = self.dtype
            return []
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
            self.notes.append(("kv_cache_dtype", "fp8_e4m3", "fp8 = fp8_e4m3 (as in vLLM)"))
        if self.kv_cache_dtype == "fp8_e4m3" and self.device == "cuda" and self.attention_backend in ("auto", "triton"):
            import torch

            capability = torch.cuda.get_device_capability()
            if capability < (8, 9):  # Triton's e4m3 type (fp8e4nv) compiles only for sm_89 and newer
                return [
                    ConfigProblem(
                        "kv_cache_dtype", "fp8_e4m3", "needs a GPU of compute capability 8.9 or newer (Ada, Hopper) "
                        f"for the Triton kernels; this one is {capability[0]}.{capability[1]}. Use fp8_e5m2 or "
                        "bfloat16, or attention_backend: torch.",
                    )
                ]  # fmt: skip
        if self.kv_cache_dtype == "float16" and self.device == "cpu":
            return [
                ConfigProblem(
                    "kv_cache_dtype", "float16", "is not usable on the CPU (the CPU kernels read float32, "
                    "bfloat16 and fp8 caches). Use bfloat16 for a half-size cache, or auto.",
                )
            ]  # fmt: skip
        return []

    def _resolve_attention_backend(self, device_ok: bool, bad: set[str]) -> list[ConfigProblem]:
        from nanoinfer.attention.backend import select_backend

        if "attention_backend" in bad:
            return []
        if self.attention_backend not in ATTENTION_BACKENDS:
            return [_choice_problem("attention_backend", self.attention_backend, ATTENTION_BACKENDS)]
        if not device_ok or "dtype" in bad:
            return []
        # An unresolved or invalid kv_cache_dtype has its own problem: judge the backend by the model dtype.
        kv_dtype = self.kv_cache_dtype if self.kv_cache_dtype in KV_CACHE_DTYPES[1:] else self.dtype
        spec = self.model_spec
        max_head_dim = max((layer.head_dim for layer in spec.layers), default=None) if spec is not None else None
        head_dims = tuple({layer.head_dim for layer in spec.layers}) if spec is not None else ()
        try:
            backend, why = select_backend(self.attention_backend, self.device, self.dtype, kv_dtype, max_head_dim,
                                          head_dims)  # fmt: skip
        except ConfigError as e:
            return list(e.problems)
        if self.attention_backend == "auto":
            self.attention_backend = backend
            self.notes.append(("attention_backend", backend, f"auto: {why}"))
        return []

    def to_dict(self) -> dict:
        """User-settable fields and their resolved values (hf_config and notes left out)."""
        return {f: getattr(self, f) for f in user_fields()}


def user_fields() -> list[str]:
    """Every field but hf_config and notes, in declaration order (eos included: settable from Python)."""
    return [f for f in Config.__dataclass_fields__ if f not in ("hf_config", "model_spec", "notes")]


def settable_fields() -> list[str]:
    """The fields a YAML file or a CLI flag may set."""
    return [f for f in Config.__dataclass_fields__ if f not in NOT_SETTABLE]


def field_default(name: str):
    f = Config.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def type_problem(name: str, value) -> ConfigProblem | None:
    """A problem when `value` has the wrong type for field `name` (bool is not an int, "64" is not an int)."""
    kind = Config.__dataclass_fields__[name].type  # a string: `from __future__ import annotations`
    if kind not in _TYPE_NAMES:
        return None
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "bool":
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if ok:
        return None
    default = field_default(name)
    example = f"{name}: {str(default).lower() if isinstance(default, bool) else default}"
    fix = f"Write it like `{example}`."
    if value is None:
        fix = f"Give a value, or remove `{name}` to use the default ({default!r})."
    elif isinstance(value, bool) and kind != "bool":
        fix = f"YAML reads yes/no/on/off/true/false as booleans. {fix}"
    elif isinstance(value, str) and kind in ("int", "float") and _is_number(value, kind):
        fix = f"Remove the quotes: `{name}: {value.strip()}`."
    elif isinstance(value, float) and kind == "int" and value.is_integer():
        fix = f"Write it without the decimal point: `{name}: {int(value)}`."
    return ConfigProblem(name, value, f"expected {_TYPE_NAMES[kind]}, got {_describe(value)}. {fix}")


def _is_number(text: str, kind: str) -> bool:
    try:
        (int if kind == "int" else float)(text)
    except ValueError:
        return False
    return True


def _describe(value) -> str:
    if value is None:
        return "no value (null)"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, float):
        return f"a float ({value})"
    if isinstance(value, int):
        return f"an integer ({value})"
    return f"a {type(value).__name__}"


def _not_a_model_folder(model: str, path: Path) -> ConfigProblem:
    if path.is_dir():
        what = f"folder {path} has no config.json"
    elif path.exists():
        what = f"{path} is a file, not a model folder"
    else:
        what = f"folder {path} does not exist"
    return ConfigProblem(
        "model",
        model,
        f"{what}. Config reads a local Hugging Face model folder (config.json + *.safetensors + tokenizer files). "
        f"The built-in default {DEFAULT_MODEL!r}, .gguf files and hub repo ids are resolved to such a folder "
        "before Config: pass them to LLM(...) or --model, or call nanoinfer.model_source.resolve_model() first.",
    )


def _choice_problem(name: str, value, choices: tuple[str, ...]) -> ConfigProblem:
    return ConfigProblem(name, value, f"must be one of {', '.join(choices)}. Pick one of those.")


def _range_problems(c: Config, bad: set[str]) -> list[ConfigProblem]:
    """Single-field ranges and cross-field rules that do not need the model."""
    problems = []

    def check(name: str, ok, message: str):
        if name not in bad and not ok(getattr(c, name)):
            problems.append(ConfigProblem(name, getattr(c, name), message))

    check(
        "model",
        lambda v: v.strip() != "",
        f"is empty. Give a model folder, or remove it to use {DEFAULT_MODEL}.",
    )
    for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        check(
            name,
            lambda v: v >= 1,
            f"must be a positive integer. Use at least 1, e.g. the default {field_default(name)}.",
        )
    check(
        "kvcache_block_size",
        lambda v: v > 0 and v % 256 == 0,
        "must be a positive multiple of 256 (flash-attn's paged KV cache needs it). Use 256, 512, ...",
    )
    check(
        "tensor_parallel_size",
        lambda v: 1 <= v <= 8,
        "must be between 1 and 8 (one process per rank). Use 1 for a single device.",
    )
    check(
        "gpu_memory_utilization",
        lambda v: 0 < v <= 1,  # NaN fails this too
        "is the fraction of device memory the engine may use and must be in (0, 1]. Use e.g. 0.9.",
    )
    check(
        "num_kvcache_blocks",
        lambda v: v == -1 or v >= 1,
        "must be -1 (size the cache from free memory) or a positive block count. Use -1 unless you need a fixed size.",
    )
    check(
        "cpu_kvcache_space_gib",
        lambda v: v > 0 and math.isfinite(v),
        "is the CPU KV-cache budget in GiB and must be positive. Use e.g. 4.",
    )
    check(
        "num_threads",
        lambda v: v >= 0,
        "must be 0 (one thread per physical core) or a positive thread count.",
    )
    if "cpu_kernels" not in bad and c.cpu_kernels not in CPU_KERNELS:
        problems.append(_choice_problem("cpu_kernels", c.cpu_kernels, CPU_KERNELS))
    check("eos", lambda v: v >= -1, "is filled in from the tokenizer; leave it at -1.")
    problems += _lora_ranges(c, bad)
    for name, choices in (("reasoning_parser", ("auto", "none", *REASONING_PARSERS)),
                          ("tool_call_parser", ("auto", "none", *TOOL_CALL_PARSERS))):  # fmt: skip
        if name not in bad and getattr(c, name) not in choices:
            problems.append(_choice_problem(name, getattr(c, name), choices))
    if c.runner not in RUNNERS:
        problems.append(_choice_problem("runner", c.runner, RUNNERS))
        bad.add("runner")
    if c.pooling_type is not None and c.pooling_type not in POOLING_TYPES:
        problems.append(_choice_problem("pooling_type", c.pooling_type, POOLING_TYPES))
        bad.add("pooling_type")
    if c.normalize is not None and not isinstance(c.normalize, bool):
        problems.append(ConfigProblem("normalize", c.normalize, "must be true or false (or left out: the model's "
                                      "sentence-transformers config, else true)."))
        bad.add("normalize")
    check(
        "num_speculative_tokens",
        lambda v: 0 <= v <= 16,
        "is how many tokens n-gram speculation proposes a step and must be 0 (off) to 16. Use e.g. 3.",
    )
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        check(name, lambda v: 1 <= v <= 8, "is an n-gram length for speculation and must be 1 to 8. Use 1 to 3.")
    lookup_ok = not bad & {"prompt_lookup_min", "prompt_lookup_max"}
    if lookup_ok and 1 <= c.prompt_lookup_max < c.prompt_lookup_min <= 8:
        problems.append(
            ConfigProblem(
                "prompt_lookup_min",
                c.prompt_lookup_min,
                f"must be <= prompt_lookup_max ({c.prompt_lookup_max}). Lower it or raise prompt_lookup_max.",
            )
        )
    batch_ok = not bad & {"max_num_batched_tokens", "max_num_seqs"}
    if batch_ok and 1 <= c.max_num_batched_tokens < c.max_num_seqs:
        problems.append(
            ConfigProblem(
                "max_num_batched_tokens",
                c.max_num_batched_tokens,
                f"must be >= max_num_seqs ({c.max_num_seqs}): every scheduled sequence needs at least one "
                f"token per step. Raise max_num_batched_tokens to {c.max_num_seqs} or more, or lower max_num_seqs.",
            )
        )
    return problems


def _model_problems(c: Config, bad: set[str]) -> list[ConfigProblem]:
    """Checks against the loaded hf_config: a supported architecture (the registry's), whose family reads the
    config (c.model_spec), with every layer's heads divisible by tensor_parallel_size (and 1 for a family that
    runs on one rank only: supports_tensor_parallel False)."""
    c.model_spec, problem = registry.checked_model_spec(c.hf_config)
    if problem is not None:
        return [ConfigProblem("model", c.model, problem)]
    tp = c.tensor_parallel_size
    if "tensor_parallel_size" in bad or not 1 <= tp <= 8:
        return []
    if tp > 1 and not c.model_spec.supports_tensor_parallel:
        return [
            ConfigProblem(
                "tensor_parallel_size",
                tp,
                f"must be 1 for {c.model_spec.architecture}: nanoinfer does not shard this family's layers. Use "
                "tensor_parallel_size: 1.",
            )
        ]
    width = c.model_spec.expert_intermediate_size
    if width % tp:
        divisors = [d for d in range(1, 9) if width % d == 0]
        return [
            ConfigProblem(
                "tensor_parallel_size",
                tp,
                f"must divide each expert's width ({width}: every rank holds its share of every expert). Use one of "
                f"{', '.join(map(str, divisors))}.",
            )
        ]
    heads = sorted({n for layer in c.model_spec.layers for n in (layer.num_heads, layer.num_kv_heads)}
                   | {n for layer in c.model_spec.linear_attention_layers for n in (layer.num_k_heads,
                                                                                    layer.num_v_heads)})  # fmt: skip
    if any(n % tp for n in heads):
        divisors = [d for d in range(1, 9) if all(n % d == 0 for n in heads)]
        return [
            ConfigProblem(
                "tensor_parallel_size",
                tp,
                f"must divide the model's attention and KV head counts ({', '.join(map(str, heads))}) so each rank "
                f"gets whole heads. Use one of {', '.join(map(str, divisors))}.",
            )
        ]
    return []


def _hybrid_model_problems(c: Config, bad: set[str]) -> list[ConfigProblem]:
    """A hybrid model (linear-attention layers, a state per sequence) runs without prefix caching, with a notice: a
    cached prefix's KV blocks are useless without the linear layers' state at the prefix's end, which is not kept.
    n-gram speculation is refused: rejected tokens would have to be rolled out of that state."""
    if c.model_spec is None or not c.model_spec.is_hybrid:
        return []
    if c.enable_prefix_caching and "enable_prefix_caching" not in bad:
        c.enable_prefix_caching = False
        c.notes.append(("enable_prefix_caching", False, "off for a model with linear-attention layers (its prefixes "
                        "would also need the layers' state, which is not cached)"))  # fmt: skip
    if "num_speculative_tokens" not in bad and isinstance(c.num_speculative_tokens, int) and c.num_speculative_tokens:
        return [ConfigProblem(
            "num_speculative_tokens", c.num_speculative_tokens,
            f"must be 0 for {c.model_spec.architecture}: its linear-attention layers keep a state per sequence that "
            "rejected speculated tokens cannot be taken back out of. Set num_speculative_tokens: 0.",
        )]  # fmt: skip
    return []


MAX_AUTO_LORAS = 8  # max_loras 0 resolves to the adapters `loras` names, up to this many slots
MAX_LORA_RANK = 512


def auto_max_loras(num_loras: int) -> int:
    """max_loras 0: one slot an adapter `loras` names, at least 1 and at most MAX_AUTO_LORAS."""
    return max(1, min(num_loras, MAX_AUTO_LORAS))


def _lora_ranges(c: Config, bad: set[str]) -> list[ConfigProblem]:
    """LoRA fields that need no model: ranges, the loras mapping's shape; fills enable_lora, max_loras and
    max_cpu_loras in."""
    problems = []
    loras = c.loras if isinstance(c.loras, dict) else None
    if loras is None:
        problems.append(ConfigProblem("loras", c.loras, "must map adapter names to PEFT folders, e.g. `loras: "
                                      "{support: ./adapters/support}` (or --lora support=./adapters/support)."))
        bad.add("loras")
    else:
        for name, path in loras.items():
            if not isinstance(name, str) or not name.strip() or not isinstance(path, (str, os.PathLike)):
                problems.append(ConfigProblem("loras", {name: path}, "each entry is a name (a non-empty string) and "
                                              "the adapter's folder (a path string)."))  # fmt: skip
                bad.add("loras")
    for name, low, high in (("max_loras", 0, 64), ("max_lora_rank", 1, MAX_LORA_RANK), ("max_cpu_loras", 0, 1024)):
        value = getattr(c, name)
        if name not in bad and not low <= value <= high:
            problems.append(ConfigProblem(name, value, f"must be between {low} and {high}."))
            bad.add(name)
    if problems:
        return problems
    count = len(c.loras)
    if count and not c.enable_lora and "enable_lora" not in bad:
        c.enable_lora = True
        c.notes.append(("enable_lora", True, f"`loras` names {count} adapter(s)"))
    for name, path in c.loras.items():  # checked against the model later (_lora_problems), as given here
        c.loras[name] = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if c.max_loras == 0:
        c.max_loras = auto_max_loras(count)
        if c.enable_lora:
            c.notes.append(("max_loras", c.max_loras, f"one slot an adapter `loras` names (at most {MAX_AUTO_LORAS})"))
    if c.max_cpu_loras == 0:
        c.max_cpu_loras = max(c.max_loras, count)
    elif c.max_cpu_loras < c.max_loras:
        problems.append(ConfigProblem("max_cpu_loras", c.max_cpu_loras, f"must be at least max_loras ({c.max_loras}): "
                                      "an adapter in a slot stays read in host memory. Raise it, or leave it 0."))
    return problems


def _lora_problems(c: Config, bad: set[str]) -> list[ConfigProblem]:
    """Every adapter `loras` names checked against the model (all problems at once), and a model LoRA can adapt."""
    from nanoinfer.lora.peft import adapter_problems

    if not c.enable_lora or c.model_spec is None or bad & {"loras", "max_lora_rank", "enable_lora"}:
        return []
    if not c.model_spec.lora_shapes:
        return [ConfigProblem("enable_lora", True, f"{c.model_spec.architecture} has no layers nanoinfer adapts "
                              "(attention's q/k/v/o and the MLP's gate/up/down projections). Turn LoRA off.")]
    return [ConfigProblem("loras", {name: path}, problem) for name, path in c.loras.items()
            for problem in adapter_problems(path, c.max_lora_rank, c.model_spec.lora_shapes)]  # fmt: skip


def _pooling_problems(c: Config, bad: set[str]) -> list[ConfigProblem]:
    """The pooling runner's pooling_type and normalize, filled in from the model's sentence-transformers folder (or
    last + normalize) where not set; set for the generate runner, they are a mistake worth saying."""
    if bad & {"runner", "pooling_type", "normalize"}:
        return []
    if c.runner != "pooling":
        given = [name for name in ("pooling_type", "normalize") if getattr(c, name) is not None]
        problems = [ConfigProblem(name, getattr(c, name), "applies only to embeddings (runner: pooling). Remove it, "
                                  "or set runner: pooling (`nanoinfer embed` does).") for name in given]  # fmt: skip
        if c.hf_config is not None and registry.is_base_checkpoint(c.hf_config):
            problems.append(ConfigProblem("runner", c.runner, f"must be pooling for {c.model}: it is a base model "
                                          f"({c.hf_config.architectures[0]}) without an LM head, which makes "
                                          "embeddings, not text. Use `nanoinfer embed` or runner: pooling."))
        return problems
    try:  # read whatever is set: a module nanoinfer cannot run is a problem before the weights load
        folder = read_sentence_transformers_folder(c.model)
    except ConfigError as e:
        return e.problems
    if folder is not None and folder.pooling_type is None and c.pooling_type is None:
        return [ConfigProblem("pooling_type", None, f"is not set, and the model's sentence-transformers config pools "
                              f"by {folder.modes}, which nanoinfer does not do (it pools by one of last token, mean "
                              "or cls). Set --pooling (pooling_type) to one of last, mean, cls.")]
    pooling_type, normalize = (folder.pooling_type, folder.normalize) if folder else ("last", True)
    from_folder = folder is not None
    source = "the model's sentence-transformers config" if from_folder else "the default"
    for name, value in (("pooling_type", pooling_type), ("normalize", normalize)):
        if getattr(c, name) is None:
            setattr(c, name, value)
            c.notes.append((name, value, f"from {source}"))
    return []


def _cpu_weights_problem(c: Config) -> list[ConfigProblem]:
    """On CPU, weights (safetensors headers, in the run's dtype) larger than the machine's RAM: loading them would
    end in the kernel's OOM killer, not an error, so say it first (a mixture of experts holds every expert). GGUF
    folders are left out: their quantized weights load smaller than a count in dtype says."""
    from nanoinfer import memory

    if not any(Path(c.model).glob("*.safetensors")):
        return []
    total = memory.total_ram_bytes()
    weights = memory.weights_bytes_from_checkpoint(c.model, c.dtype, c.model_spec)
    if total is None or weights <= 0.95 * total:
        return []
    smaller = " Use dtype: bfloat16 (half of float32's bytes)," if c.dtype == "float32" else " Use"
    return [ConfigProblem(
        "model", c.model,
        f"its weights take {memory.describe_weights(c.model_spec, weights)} in {c.dtype}, more than this machine's "
        f"RAM ({memory.format_bytes(total)}).{smaller} a quantized GGUF of the model, or a machine with more memory.",
    )]  # fmt: skip


def _kvcache_capacity_problem(c: Config, bad: set[str]) -> list[ConfigProblem]:
    """A user-set num_kvcache_blocks must hold one max_model_len sequence (checked after clamping)."""
    if bad & {"num_kvcache_blocks", "kvcache_block_size", "max_model_len"}:
        return []
    if (
        c.num_kvcache_blocks < 1
        or c.kvcache_block_size <= 0
        or c.kvcache_block_size % 256
        or c.max_model_len < 1
    ):
        return []
    capacity = c.num_kvcache_blocks * c.kvcache_block_size
    if capacity >= c.max_model_len:
        return []
    minimum = -(-c.max_model_len // c.kvcache_block_size)
    return [
        ConfigProblem(
            "num_kvcache_blocks",
            c.num_kvcache_blocks,
            f"holds {capacity} tokens ({c.num_kvcache_blocks} x {c.kvcache_block_size}), fewer than one "
            f"max_model_len sequence ({c.max_model_len}). Use at least {minimum} blocks, lower max_model_len, "
            "or -1 to size the cache from memory.",
        )
    ]
