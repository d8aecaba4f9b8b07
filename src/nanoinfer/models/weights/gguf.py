"""GGUF files as a weight format, read with the `gguf` package (llama.cpp's own reader).

A GGUF model runs from a folder that holds the .gguf and its Hugging Face metadata: config.json from the
file's metadata, the tokenizer and chat template converted by transformers' GGUF support, generation_config.
`model_source` builds that folder once (no weights in it: a link to the file), or uses HF files a folder
already has beside its GGUF. Weights load from the GGUF at every start: each tensor dequantized to float32 and
cast to the model's dtype by the layer's own weight loader; where the platform's linear method reads them (the
CPU kernels, float32), the Q4_0 / Q4_1 blocks of the linears are kept for it as they are, never found again from
floats (platforms/cpu/linear.py, compact_from_blocks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from nanoinfer.errors import ModelLoadError
from nanoinfer.models import registry

# What the gguf package dequantizes and nanoinfer was tested with; the K-quants are what Q4_K_M files hold.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BLOCK_TYPES = ("Q4_0", "Q4_1")  # read as blocks by the CPU float32 4-bit GEMM; all others are dequantized
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
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


_SHARD = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's gguf-split names


def gguf_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.gguf") if p.is_file())


def model_file(folder: Path, files: list[Path]) -> Path:
    """The one model among a folder's GGUF files: a single file, or the first shard of one split model."""
    if len(files) == 1:
        return files[0]
    firsts = [p for p in files if (m := _SHARD.fullmatch(p.name)) and m.group(2) == "00001"]
    if len(firsts) == 1 and all(p in shards(firsts[0]) for p in files):
        return firsts[0]
    raise ModelLoadError(f"{folder} holds several GGUF models ({', '.join(p.name for p in files)}); keep one model "
                         "per folder (a split model's *-0000i-of-0000N.gguf shards count as one).")


def shards(path: Path) -> list[Path]:
    """Every file of the model `path` starts: itself, or all N shards of a split model (each must exist)."""
    m = _SHARD.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m.group(3))
    paths = [path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path} is shard 1 of {count}, but {', '.join(missing)} are missing beside it.")
    return paths


def open_gguf(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}).") from None


def field(reader, key: str):
    value = reader.fields.get(key)
    return None if value is None else value.contents()


def architecture(reader, path: Path) -> str:
    arch = field(reader, "general.architecture")
    if registry.gguf_architecture(arch) is None:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; nanoinfer runs "
                             f"{', '.join(registry.supported_gguf_architectures())} GGUF files.")
    return arch


# ---- metadata -> a Hugging Face folder (config.json, tokenizer, generation_config.json) ------------------
def hf_config(reader, path: Path) -> dict:
    """config.json for the GGUF's model, from its metadata (llama.cpp's keys)."""
    arch = architecture(reader, path)
    class_name = registry.gguf_architecture(arch)
    model_type = registry.model_type_of(class_name)

    def meta(key, default=None):
        value = field(reader, f"{arch}.{key}")
        return default if value is None else value

    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} in a GGUF is not supported yet; use the model's "
                             "Hugging Face folder instead.")
    num_heads, hidden = meta("attention.head_count"), meta("embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": [class_name],
        "model_type": model_type,
        "vocab_size": meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "head_dim": meta("attention.key_length", hidden // num_heads),
        "hidden_act": "silu",
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": float(np.float32(meta("attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def write_metadata_folder(gguf_path: Path, out: Path) -> None:
    """The GGUF's config.json, generation_config.json and tokenizer files into `out` (no weights)."""
    from transformers import AutoTokenizer, GenerationConfig

    reader = open_gguf(gguf_path)
    config = hf_config(reader, gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"],
                     pad_token_id=config["pad_token_id"]).save_pretrained(out)
    try:  # transformers builds a fast (tokenizers) tokenizer from the GGUF's vocabulary and merges
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise ModelLoadError(f"{gguf_path}: its tokenizer cannot be converted by transformers ({e}). Put the "
                             "model's tokenizer.json and config.json beside the GGUF.") from None
    tokenizer.save_pretrained(out)
    finish_tokenizer(out, field(reader, "tokenizer.ggml.pre"), field(reader, "tokenizer.chat_template"),
                     config["max_position_embeddings"])


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
def hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent nanoinfer knows.")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{kind}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders a Llama head's q/k rows from HF's half-split rotary layout to interleaved
    # pairs; swapping the (half, pair) axes back gives the layout HF's LlamaAttention (and ours) expects.
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape).copy()


def q4_blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 tensor's blocks as row-major (d, m, q): float16 [N, K/32] twice and uint8 [N, K] in 0..15;
    each value is d * q + m (Q4_0: m = -8 d, exact in float16)."""
    rows = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1)
    q4_1 = tensor.tensor_type.name == "Q4_1"
    block_bytes = 20 if q4_1 else 18
    blocks = rows.reshape(rows.shape[0], -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if q4_1 else (-8 * d.astype(np.float32)).astype(np.float16)
    packed = blocks[..., 4:20] if q4_1 else blocks[..., 2:18]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # value i in the low nibble of byte i, i + 16 high
    return d, m, q.reshape(rows.shape[0], -1)


def load_gguf_weights(model: torch.nn.Module, gguf_path: Path, hf_config) -> None:
    """Every tensor of the GGUF into `model` through the layers' weight loaders (names as in HF checkpoints)."""
    # numpy asks for huge pages on its large arrays; freed, their memory stays in the heap (the CPU platform keeps
    # freed blocks), where later allocations would inherit the advice.
    previous = _set_numpy_huge_pages(False)
    try:
        _load_gguf_weights(model, gguf_path, hf_config)
    finally:
        _set_numpy_huge_pages(previous)


def _set_numpy_huge_pages(enabled: bool) -> bool:
    multiarray = getattr(np, "_core", None) or np.core
    setter = getattr(multiarray.multiarray, "_set_madvise_hugepage", None)
    return setter(enabled) if setter is not None else enabled


def _load_gguf_weights(model: torch.nn.Module, gguf_path: Path, hf_config) -> None:
    from gguf import dequantize

    from nanoinfer.models.weights.loading import WeightLoading

    architecture(open_gguf(gguf_path), gguf_path)
    loading = WeightLoading(model)
    unpermute_qk = getattr(model, "gguf_unpermute_qk", False)
    tensors = [t for shard in shards(gguf_path) for t in open_gguf(shard).tensors]
    for tensor in tensors:
        kind = tensor.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ModelLoadError(f"{gguf_path}: tensor {tensor.name} is of type {kind}, which nanoinfer does not "
                                 f"load; it loads {', '.join(TENSOR_TYPES)}. Use a file quantized to one of them.")
        name = hf_name(tensor.name)
        found = loading.target(name)
        if found is None:
            continue
        target, shard_id = found
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        heads = None
        if unpermute_qk and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hf_config.num_attention_heads if "attn_q" in tensor.name else hf_config.num_key_value_heads
            values = unpermute_rotary(values, heads)
        weight = torch.from_numpy(np.require(values, requirements=["C", "W"]))  # an F32 tensor is a read-only map
        loading.copy(name, target, shard_id, weight)
        if kind in BLOCK_TYPES and name.endswith("proj.weight"):
            blocks = q4_blocks(tensor)
            if heads is not None:  # the same rows, in the same order as the values
                blocks = tuple(unpermute_rotary(b, heads) for b in blocks)
            _keep_blocks(model, target, shard_id, blocks)
    loading.finish(gguf_path)


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
    module.q4_blocks[offset] = tuple(torch.from_numpy(np.ascontiguousarray(b)) for b in blocks)
