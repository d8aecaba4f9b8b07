"""Tiny random-weight models written as GGUF files with the `gguf` package, as llama.cpp's converter writes
them: llama.cpp's tensor names, Llama's q/k rows in GGML's rotary order, the tokenizer in the metadata. The
linears take the tensor type asked for; norms stay F32, the embedding F16 (as llama.cpp's quantizer leaves
small and sensitive tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nanoinfer.testing.tiny_models import build_tiny_model

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{kind}"


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's half-split rotary rows -> GGML's interleaved pairs (what llama.cpp's converter does for Llama)."""
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape).copy()


def build_tiny_gguf(family: str, path: str | Path, tensor_type: str = "F32", *, seed: int = 0,
                    **model_kwargs) -> Path:
    """Write `family`'s tiny model as `path` (a .gguf file), its linears in `tensor_type`; returns the path.

    K-quants (Q4_K, Q6_K, ...) need rows of a multiple of 256: pass hidden_size / intermediate_size to match.
    The gguf package cannot quantize to them, so their blocks are random bytes with sane scales (a valid
    GGUF whose dequantized values are what both nanoinfer and transformers then run).
    """
    import gguf
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    hf_dir = build_tiny_model(family, path.with_suffix(".hf"), seed=seed, **model_kwargs)
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, hf_dir)
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        data = tensor.to(torch.float32).numpy()
        if family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            data = permute_rotary(data, heads)
        if data.ndim == 2 and name != "model.embed_tokens.weight" and name != "lm_head.weight":
            _add_quantized(writer, gguf, gguf_name(name), data, qtype, rng)
        elif data.ndim == 2:
            writer.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_quantized(writer, gguf, name: str, data: np.ndarray, qtype, rng) -> None:
    if qtype.name in K_QUANTS:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(data.shape[0], data.shape[1] // block_elems * block_bytes), dtype=np.uint8)
        _sane_k_quant_scales(raw, qtype.name, block_bytes, rng)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    elif qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)


def _sane_k_quant_scales(raw: np.ndarray, kind: str, block_bytes: int, rng) -> None:
    """Overwrite each block's float16 super-scales with small values (random bytes could make them huge)."""
    blocks = raw.reshape(-1, block_bytes)
    scale = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":  # ql, qh, int8 scales, then d: keep the scales small too
        blocks[:, 192:208] = rng.integers(-8, 8, size=(blocks.shape[0], 16), dtype=np.int8).view(np.uint8)
        blocks[:, -2:] = scale[:, :2]
    else:  # Q2_K..Q5_K: d and dmin first
        blocks[:, 0:4] = scale
    raw[...] = blocks.reshape(raw.shape)


def _add_tokenizer(writer, hf_dir: Path) -> None:
    """The tiny model's byte-level BPE tokenizer as GGUF metadata (llama.cpp's "gpt2" tokenizer model)."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens = [None] * (max([*vocab.values(), *added.values()]) + 1)
    for text, i in {**vocab, **added}.items():
        tokens[i] = text
    types = [3 if t in added else 1 for t in tokens]  # 3: control, 1: normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(added[tok_config["eos_token"]])
    writer.add_pad_token_id(added[tok_config["pad_token"]])
    writer.add_add_bos_token(False)
    from nanoinfer.testing.tiny_models import CHAT_TEMPLATE

    writer.add_chat_template(tok_config.get("chat_template") or CHAT_TEMPLATE)
