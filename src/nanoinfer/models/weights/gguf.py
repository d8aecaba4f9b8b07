"""GGUF files as a weight format, read with the `gguf` package (llama.cpp's own reader).

A GGUF model runs from a folder that holds the .gguf (or all shards of a split one) and its Hugging Face
metadata: config.json from the file's metadata, the tokenizer and chat template converted by transformers' GGUF
support, generation_config. `model_source` builds that folder once (no weights in it: links to the files), or uses
HF files a folder already has beside its GGUF. Weights load from the GGUF at every start, each file parsed once
(GGUFModel): each tensor dequantized to float32 and cast to the model's dtype by the layer's own weight loader;
where the platform's linear method reads them (the CPU kernels, float32), the Q4_0 / Q4_1 blocks of the linears
are kept for it as they are, never found again from floats (platforms/cpu/linear.py, compact_from_blocks).

This file is generic; what llama.cpp's converter does differently per architecture is the family's (its class,
in models/<family>.py): `gguf_config(gguf)` (config.json fields from the metadata and rope tensors),
`gguf_tensor_names` (GGUF block tensor -> HF module, where they differ from Llama's), `gguf_norm_offset` (a
constant the converter added to every norm weight), `gguf_unpermute_qk` (q/k rows interleaved for GGML's rotary).
Mixture-of-experts layers are generic too: llama.cpp writes each projection of all of a layer's experts as one
tensor, [experts, rows, columns] (ffn_gate_exps, ffn_up_exps, ffn_down_exps; their biases [experts, rows]), which
loads as each expert's.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import torch

from nanoinfer.errors import ModelLoadError
from nanoinfer.models import registry

# What the gguf package dequantizes and nanoinfer was tested with; the K-quants are what Q4_K_M files hold, MXFP4
# what gpt-oss's experts are published in (llama.cpp's converter repacks their blocks as they are).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "MXFP4")
BLOCK_TYPES = ("Q4_0", "Q4_1")  # read as blocks by the CPU float32 4-bit GEMM; all others are dequantized
# llama.cpp's block tensor names -> HF module paths, as its converter maps a Llama; a family overrides some
# (gguf_tensor_names: Gemma 2's sandwich norms, Phi-3's fused projections)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    # every expert's projection in one tensor (expert_parts splits it); llama.cpp's --fuse-gate-up-exps writes
    # gate and up as one, each expert's gate rows then its up rows
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors the converter writes for the config, not the model: rope scaling (read by the families' gguf_config)
CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


_SHARD = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's gguf-split names


def gguf_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.gguf") if p.is_file())


def model_file(folder: Path, files: list[Path]) -> Path:
    """The one model among a folder's GGUF files: a single file, or the first shard of one split model (every
    shard must be there)."""
    firsts = {first_shard(p) for p in files}
    if len(firsts) == 1:
        first = firsts.pop()
        shards(first)  # a missing shard is an error naming it
        return first
    raise ModelLoadError(f"{folder} holds several GGUF models ({', '.join(p.name for p in files)}); keep one model "
                         "per folder (a split model's *-0000i-of-0000N.gguf shards count as one).")


def first_shard(path: Path) -> Path:
    """Shard 1 of the split model `path` is a shard of (its metadata is there), or `path` itself."""
    m = _SHARD.fullmatch(path.name)
    return path if m is None else path.with_name(f"{m.group(1)}-00001-of-{m.group(3)}.gguf")


def shards(path: Path) -> list[Path]:
    """Every file of the model `path` starts: itself, or all N shards of a split model (each must exist)."""
    m = _SHARD.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m.group(3))
    paths = [path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path.name} is one of {count} shards of a split GGUF model, but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}. Put every "
                             "shard in the same folder (download the missing ones again).")
    return paths


class _Reader:
    """Makes GGUFReader parse over a plain ndarray view of its memory map: parsing slices the map twice per
    metadata string, and a 49k-token vocabulary's ~200k np.memmap slices cost 3x a plain view's (1.7 s -> 0.5 s
    for the default model). The view reads the same mapped bytes."""

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray)


@functools.cache
def _reader_class():
    from gguf import GGUFReader

    return type("Reader", (_Reader, GGUFReader), {})


def open_gguf(path: Path):
    """One GGUF file parsed by the gguf package (its metadata and tensor index; tensor data stays mapped)."""
    try:
        return _reader_class()(path)
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}).") from None


def field(reader, key: str):
    value = reader.fields.get(key)
    return None if value is None else value.contents()


def float32_value(value):
    """A float32 metadata value as the decimal it was written from (np.float32(1e-06) -> 1e-06, not
    9.99999997e-07), so that config.json holds what the model's own config.json held."""
    return None if value is None else float(str(np.float32(value)))


class GGUFModel:
    """One GGUF model, each file parsed once: shard 1's metadata (all of it: gguf-split puts only split.* keys
    in the others) and every shard's tensors."""

    def __init__(self, path: Path):
        self.path = Path(path)
        paths = shards(self.path)
        self.readers = [open_gguf(p) for p in paths]
        self.arch = field(self.readers[0], "general.architecture")
        if self.architecture is None:
            raise ModelLoadError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; nanoinfer runs "
                                 f"{', '.join(registry.supported_gguf_architectures())} GGUF files.")
        self.tensors = [t for reader in self.readers for t in reader.tensors]
        self._by_name = {t.name: t for t in self.tensors}
        self._check_split(len(paths))

    def _check_split(self, num_files: int) -> None:
        count, expected = self.field("split.count"), self.field("split.tensors.count")
        if count is None and num_files == 1:
            return
        if count != num_files or (expected is not None and expected != len(self.tensors)):
            raise ModelLoadError(f"{self.path}: the split GGUF's metadata says {count} shards holding {expected} "
                                 f"tensors, but its {num_files} shard files hold {len(self.tensors)}. The shards are "
                                 "not all of one model; download the split model's shards again.")

    @property
    def architecture(self) -> str | None:
        """The HF architecture that runs this file: its general.architecture's, or, for a llama with experts
        (expert_count > 0), Mixtral's."""
        return registry.gguf_architecture(self.arch, has_experts=bool(self.meta("expert_count")))

    @property
    def family(self) -> type:
        """The family class that runs this file (and knows how llama.cpp wrote it)."""
        return registry.model_class(self.architecture)

    def field(self, key: str, default=None):
        value = field(self.readers[0], key)
        return default if value is None else value

    def meta(self, key: str, default=None):
        """The architecture's own key, e.g. meta("context_length") reads "llama.context_length"."""
        return self.field(f"{self.arch}.{key}", default)

    def meta_float(self, key: str, default=None):
        return float32_value(self.meta(key, default))

    def expert_counts(self) -> tuple[int, int]:
        """(expert_count, expert_used_count) of a mixture-of-experts model; both must be set (llama.cpp refuses
        the file otherwise)."""
        experts, used = self.meta("expert_count"), self.meta("expert_used_count")
        if not experts or not used:
            raise ModelLoadError(f"{self.path}: a {self.arch} GGUF with experts needs {self.arch}.expert_count and "
                                 f"{self.arch}.expert_used_count in its metadata (it has {experts} and {used}). "
                                 "Convert the model again with llama.cpp's convert_hf_to_gguf.py.")
        return experts, used

    def tensor(self, name: str):
        return self._by_name.get(name)

    def rope_scaling(self) -> dict | None:
        """The rope scaling llama.cpp states in metadata alike for every architecture (what a family reads from its
        tensors, e.g. Llama 3's rope_freqs, is its gguf_config's): linear, or YaRN with the keys the converter
        writes from the HF config's (factor, original context, beta_fast / beta_slow, attention_factor)."""
        kind = self.meta("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": self.meta_float("rope.scaling.factor")}
        if kind == "yarn" and self.meta("rope.scaling.yarn_ext_factor", 1.0) == 1.0:  # HF's YaRN has no other
            optional = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow",
                        "attention_factor": "yarn_attn_factor"}  # fmt: skip
            return {"rope_type": "yarn", "factor": self.meta_float("rope.scaling.factor"),
                    "original_max_position_embeddings": self.meta("rope.scaling.original_context_length"),
                    **{hf: self.meta_float(f"rope.scaling.{key}") for hf, key in optional.items()
                       if self.meta(f"rope.scaling.{key}") is not None}}  # fmt: skip
        raise ModelLoadError(f"{self.path}: rope scaling {kind!r} in a {self.arch} GGUF is not supported yet; use the "
                             "model's Hugging Face folder instead.")

    def values(self, name: str) -> np.ndarray | None:
        """Tensor `name` dequantized to float32, or None when the file has none of that name."""
        from gguf import dequantize

        tensor = self.tensor(name)
        return None if tensor is None else np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


# ---- metadata -> a Hugging Face folder (config.json, tokenizer, generation_config.json) ------------------
def hf_config(model: GGUFModel) -> dict:
    """config.json for the GGUF's model: the fields every llama.cpp architecture writes alike (its keys), then the
    family's own (gguf_config: sliding windows, soft caps, rope scaling, ...)."""
    class_name = model.architecture
    num_heads, hidden = model.meta("attention.head_count"), model.meta("embedding_length")
    config = {
        "architectures": [class_name],
        "model_type": registry.model_type_of(class_name),
        "vocab_size": _vocab_size(model),
        "hidden_size": hidden,
        "intermediate_size": model.meta("feed_forward_length"),
        "num_hidden_layers": model.meta("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": model.meta("attention.head_count_kv", num_heads),
        "head_dim": model.meta("attention.key_length", hidden // num_heads),
        "hidden_act": "silu",
        "max_position_embeddings": model.meta("context_length"),
        "rms_norm_eps": model.meta_float("attention.layer_norm_rms_epsilon"),
        "rope_theta": model.meta_float("rope.freq_base", 10000.0),
        "tie_word_embeddings": model.tensor("output.weight") is None,  # llama.cpp writes no tied head
        "bos_token_id": model.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": model.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": model.field("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    own = model.family.gguf_config(model)
    if "rope_scaling" not in own:
        config["rope_scaling"] = model.rope_scaling()
    return config | own


def _vocab_size(model: GGUFModel) -> int:
    """The embedding's rows: Gemma 3's converter drops out-of-vocabulary rows and writes no vocab_size."""
    embedding = model.tensor("token_embd.weight")
    if embedding is not None:
        return int(embedding.shape[-1])  # GGML's dims: [hidden, vocab]
    return model.meta("vocab_size") or len(model.readers[0].fields["tokenizer.ggml.tokens"].data)


def write_metadata_folder(gguf_path: Path, out: Path) -> None:
    """The GGUF's config.json, generation_config.json and tokenizer files into `out` (no weights); a split
    model's from its first shard."""
    from transformers import GenerationConfig

    model = GGUFModel(gguf_path)
    config = hf_config(model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"],
                     pad_token_id=config["pad_token_id"]).save_pretrained(out)
    _gguf_tokenizer(gguf_path).save_pretrained(out)
    finish_tokenizer(out, model.field("tokenizer.ggml.pre"), model.field("tokenizer.chat_template"),
                     config["max_position_embeddings"])


def _gguf_tokenizer(gguf_path: Path):
    """The fast (tokenizers) tokenizer transformers builds from the GGUF's vocabulary and merges. AutoTokenizer
    first reads the file's model config, which transformers does for some architectures only (not gemma, olmo2);
    the tokenizer needs none of it, so those go to the generic fast class (as does gpt-oss: transformers 5's reader of
    its config fails on the rope scaling keys with a TypeError)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    errors = []
    for tokenizer_class in (AutoTokenizer, PreTrainedTokenizerFast):
        try:
            return tokenizer_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except (ValueError, KeyError, OSError, NotImplementedError, TypeError) as e:
            errors.append(e)
    raise ModelLoadError(f"{gguf_path}: its tokenizer cannot be converted by transformers ({errors[-1]}). Put the "
                         "model's tokenizer.json and config.json beside the GGUF.")


def finish_tokenizer(out: Path, pre: str | None, chat_template: str | None, model_max_length: int) -> None:
    """Make the saved tokenizer portable across transformers versions and faithful to the original."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only", "backend"):  # load-time state, not tokenizer settings
        config.pop(key, None)
    # Older transformers do not know the class name newer ones save; this one loads everywhere.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = model_max_length
    if chat_template:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if pre == "smollm":
        # SmolLM's own tokenizer splits digits one by one before the byte-level split (llama.cpp's
        # "smollm" pre-tokenizer does the same); transformers' GGUF converter leaves that step out.
        tok_path = out / "tokenizer.json"
        tok = json.loads(tok_path.read_text())
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        tok["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        }
        tok_path.write_text(json.dumps(tok, ensure_ascii=False))


# ---- weights ------------------------------------------------------------------------------------------------
def hf_name(gguf_name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if not match or match.group(2) not in layer_names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent nanoinfer knows.")
    module = layer_names[match.group(2)]
    if module.endswith(".sinks"):  # a bare parameter in HF (gpt-oss's self_attn.sinks); the converter added .weight
        return f"model.layers.{match.group(1)}.{module}"
    return f"model.layers.{match.group(1)}.{module}.{kind}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders a Llama head's q/k rows from HF's half-split rotary layout to interleaved
    # pairs; swapping the (half, pair) axes back gives the layout HF's LlamaAttention (and ours) expects.
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape).copy()


def q4_blocks(tensor, heads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 tensor's blocks as row-major (d, m, q): float16 [N, K/32] twice and uint8 [N, K] in 0..15;
    each value is d * q + m (Q4_0: m = -8 d, exact in float16). `heads`: un-permute Llama's q/k rows (as the
    values)."""
    rows = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1)
    q4_1 = tensor.tensor_type.name == "Q4_1"
    block_bytes = 20 if q4_1 else 18
    blocks = rows.reshape(rows.shape[0], -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if q4_1 else (-8 * d.astype(np.float32)).astype(np.float16)
    packed = blocks[..., 4:20] if q4_1 else blocks[..., 2:18]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # value i in the low nibble of byte i, i + 16 high
    result = (d, m, q.reshape(rows.shape[0], -1))
    return result if heads is None else tuple(unpermute_rotary(b, heads) for b in result)


def load_gguf_weights(model: torch.nn.Module, gguf_path: Path, hf_config) -> None:
    """Every tensor of the GGUF into `model` through the layers' weight loaders (names as in HF checkpoints)."""
    # numpy asks for huge pages on its large arrays; freed, their memory stays in the heap (the CPU platform keeps
    # freed blocks), where later allocations would inherit the advice.
    previous = _set_numpy_huge_pages(False)
    try:
        _load_gguf_weights(model, GGUFModel(gguf_path), hf_config)
    finally:
        _set_numpy_huge_pages(previous)


def _set_numpy_huge_pages(enabled: bool) -> bool:
    multiarray = getattr(np, "_core", None) or np.core
    setter = getattr(multiarray.multiarray, "_set_madvise_hugepage", None)
    return setter(enabled) if setter is not None else enabled


def _load_gguf_weights(model: torch.nn.Module, gguf: GGUFModel, hf_config) -> None:
    from nanoinfer.models.weights.loading import WeightLoading

    loading = WeightLoading(model)
    layer_names = {**_LAYER_NAMES, **getattr(model, "gguf_tensor_names", {})}
    _check_experts(model, gguf, layer_names)
    _check_sinks(model, gguf, layer_names)
    for tensor in gguf.tensors:
        if tensor.name.rpartition(".")[0] in CONFIG_TENSORS:
            continue  # already in config.json
        kind = tensor.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ModelLoadError(f"{gguf.path}: tensor {tensor.name} is of type {kind}, which nanoinfer does not "
                                 f"load; it loads {', '.join(TENSOR_TYPES)}. Use a file quantized to one of them.")
        _load_tensor(model, loading, tensor, hf_name(tensor.name, layer_names), hf_config)
    loading.finish(gguf.path)


def _load_tensor(model: torch.nn.Module, loading, tensor, name: str, hf_config) -> None:
    """One GGUF tensor through the family's sanitize (which may rename it or split its rows, as Phi-3's fused
    projections) into the parameters it fills, a tensor of every expert's projection as each expert's; a dense
    linear's 4-bit blocks, split the same way, to their linears."""
    sanitize = getattr(model, "sanitize", None) or (lambda name, fn: [(name, fn)])
    heads = _rotary_heads(model, tensor.name, hf_config)
    values = functools.cache(lambda: torch.from_numpy(_float_values(model, tensor, heads)))  # read once, if kept
    experts = expert_parts(name, int(tensor.shape[-1]), values)  # GGML's dims: the experts last
    tensors = experts or [(name, values)]
    parts = [(part, loading.target(part), fn) for hf, hf_fn in tensors for part, fn in sanitize(hf, hf_fn)]
    for part, found, fn in parts:
        if found is not None:
            loading.copy(part, *found, fn())
    if tensor.tensor_type.name in BLOCK_TYPES and name.endswith("proj.weight") and experts is None:
        # sanitize selects rows, and a row's blocks are a row too: the same parts of d, m and q
        blocks = [sanitize(name, lambda b=b: torch.from_numpy(b)) for b in q4_blocks(tensor, heads)]
        for (_, found, _), *block_parts in zip(parts, *blocks, strict=True):
            if found is not None:
                _keep_blocks(model, *found, tuple(fn() for _, fn in block_parts))


# a tensor of every expert's projection (HF name from _LAYER_NAMES), [experts, rows, columns]
_ALL_EXPERTS = re.compile(r"(.*\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)\.(weight|bias)")


def expert_parts(name: str, num_experts: int, values) -> list[tuple[str, object]] | None:
    """(HF name, tensor function) of each expert's projection in a tensor of all of them (named as transformers'
    per-expert checkpoints: experts.{e}.gate_proj.weight), or None for any other tensor; a fused gate/up tensor
    gives each expert's gate and up halves."""
    match = _ALL_EXPERTS.fullmatch(name)
    if match is None:
        return None
    prefix, proj, kind = match.groups()
    if proj != "gate_up_proj":
        return [(f"{prefix}.{e}.{proj}.{kind}", lambda e=e: values()[e]) for e in range(num_experts)]
    return [(f"{prefix}.{e}.{half}.{kind}", lambda e=e, i=i: values()[e].chunk(2)[i])
            for e in range(num_experts) for i, half in enumerate(("gate_proj", "up_proj"))]  # fmt: skip


def _check_experts(model: torch.nn.Module, gguf: GGUFModel, layer_names: dict[str, str]) -> None:
    """Each MoE layer's expert tensors (and their biases, where the experts have them) are in the file, shaped as the
    model its metadata describes takes them: a missing or mis-shaped one is an error naming it (not a list of every
    expert's shards, nor torch's copy error)."""
    stems = {hf: stem for stem, hf in layer_names.items()}
    for module_name, module in model.named_modules():
        match = re.fullmatch(r".*\blayers\.(\d+)\.(.+)", module_name)
        if not getattr(module, "uses_expert_method", False) or match is None:
            continue
        block, path = match.groups()
        experts, hidden = module.num_experts, module.hidden_size
        width = module.intermediate_size * module.tp_size
        projections = {"gate_proj": (experts, width, hidden), "up_proj": (experts, width, hidden),
                       "down_proj": (experts, hidden, width)}  # fmt: skip
        fused = f"blk.{block}.{stems.get(f'{path}.gate_up_proj')}.weight"
        if gguf.tensor(fused) is not None:
            projections = {"gate_up_proj": (experts, 2 * width, hidden), "down_proj": projections["down_proj"]}
        kinds = ("weight", "bias") if getattr(module, "w13_bias", None) is not None else ("weight",)
        for proj, shape in projections.items():
            for kind in kinds:
                _check_expert_tensor(gguf, f"blk.{block}.{stems.get(f'{path}.{proj}')}.{kind}",
                                     shape if kind == "weight" else shape[:2], block, width)  # fmt: skip


def _check_expert_tensor(gguf: GGUFModel, tensor_name: str, shape: tuple[int, ...], block: str, width: int) -> None:
    experts, hidden = shape[0], gguf.meta("embedding_length")
    tensor = gguf.tensor(tensor_name)
    if tensor is None:
        raise ModelLoadError(f"{gguf.path}: tensor {tensor_name} is missing: layer {block} has {experts} experts "
                             "(expert_count), and llama.cpp writes each of their projections (and biases) as one "
                             "tensor of all of them. The file is incomplete; convert the model again.")
    found = tuple(int(n) for n in reversed(tensor.shape))  # GGML's dims are the reverse of torch's
    if found != shape:
        axes = "[experts, rows, columns]" if len(shape) == 3 else "[experts, rows]"
        raise ModelLoadError(f"{gguf.path}: tensor {tensor_name} has shape {found} {axes}, but the model its metadata "
                             f"describes takes {shape} (expert_count {experts}, embedding length {hidden}, expert "
                             f"feed-forward length {width}). The file's metadata and tensors disagree; convert the "
                             "model again.")


def _check_sinks(model: torch.nn.Module, gguf: GGUFModel, layer_names: dict[str, str]) -> None:
    """Each layer whose attention has sinks (gpt-oss) has its sinks tensor: a missing one is an error naming it."""
    stem = {hf: stem for stem, hf in layer_names.items()}.get("self_attn.sinks")
    for module_name, module in model.named_modules():
        match = re.fullmatch(r".*\blayers\.(\d+)\.self_attn", module_name)
        if match is None or getattr(module, "sinks", None) is None:
            continue
        tensor_name = f"blk.{match.group(1)}.{stem}.weight"
        if gguf.tensor(tensor_name) is None:
            raise ModelLoadError(f"{gguf.path}: tensor {tensor_name} is missing: the {gguf.arch} architecture's "
                                 "attention has a learned sink logit per head in every layer. The file is incomplete; "
                                 "convert the model again.")


def _rotary_heads(model: torch.nn.Module, gguf_name: str, hf_config) -> int | None:
    """The heads of a q/k projection whose rows llama.cpp interleaved (gguf_unpermute_qk), else None."""
    if not getattr(model, "gguf_unpermute_qk", False):
        return None
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return hf_config.num_attention_heads
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return hf_config.num_key_value_heads
    return None


def _float_values(model: torch.nn.Module, tensor, heads: int | None) -> np.ndarray:
    from gguf import dequantize

    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    offset = getattr(model, "gguf_norm_offset", 0.0)
    if offset and tensor.name.endswith("norm.weight"):
        values = values - np.float32(offset)  # exact for the (1 + w) >= 0.5 of real norms
    if heads is not None:
        values = unpermute_rotary(values, heads)
    return np.require(values, requirements=["C", "W"])  # an F32 tensor is a read-only map


def _keep_blocks(model: torch.nn.Module, target: str, shard_id, blocks) -> None:
    """Remember a 4-bit tensor's blocks on its layer, at the rows its shard fills (one rank only: a shard of a
    rank is not whole blocks of rows in general), where the platform's linear method packs them as they are."""
    module = model.get_submodule(target.rsplit(".", 1)[0])
    if getattr(module, "tp_size", 1) != 1 or not module.platform.reads_q4_blocks:
        return
    index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id) or 0
    offset = sum(getattr(module, "output_sizes", [0])[:index])
    if getattr(module, "q4_blocks", None) is None:
        module.q4_blocks = {}
    module.q4_blocks[offset] = tuple(b.contiguous() for b in blocks)
