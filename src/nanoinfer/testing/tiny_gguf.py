"""Tiny random-weight models written as GGUF files with the `gguf` package, as llama.cpp's converter
(convert_hf_to_gguf.py) writes them: its tensor names (the gguf package's own TensorNameMap, the converter's),
its metadata keys per architecture, Llama's (and Mixtral's) q/k rows in GGML's rotary order, Gemma's norms with the
1 of (1 + w) folded in, rope scaling as llama.cpp stores it (Llama 3's `rope_freqs`, Phi-3's longrope factor
tensors, YaRN's keys), each projection of a MoE layer's experts stacked into one [experts, rows, columns] tensor
(gpt-oss's interleaved gate/up split in two), the tokenizer in the metadata, optionally split into shards as
gguf-split does. The linears (experts included) take the tensor type asked for; norms, biases and routers stay
F32, the embedding F16 (as llama.cpp's quantizer leaves small and sensitive tensors). MXFP4 is the experts' type
only, as the converter writes a published gpt-oss checkpoint (its experts' blocks repacked, the rest as --outtype,
here F32).

Everything here is the writer's side: nanoinfer's reader (models/weights/gguf.py and the families' GGUF hooks)
never shares code with it, so the tests check one against the other.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np

from nanoinfer.testing.tiny_models import build_tiny_model

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
# tiny family -> llama.cpp architecture (gguf.MODEL_ARCH member) its converter writes
ARCHITECTURES = {
    "llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma": "GEMMA", "gemma2": "GEMMA2", "gemma3": "GEMMA3",
    "phi3": "PHI3", "phi4_mini": "PHI3", "olmo2": "OLMO2", "qwen3_moe": "QWEN3MOE", "mixtral": "LLAMA",
    "gpt_oss": "GPT_OSS",
}  # fmt: skip
# Llama 3.1's rope scaling (its published config.json), for build_tiny_gguf("llama", ..., rope_parameters=LLAMA3_ROPE)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip


def gguf_options(family: str, model_kwargs: dict) -> dict:
    """Tiny-model options the family's GGUF must have, because llama.cpp's file cannot say otherwise (the
    caller's model_kwargs still win): Gemma 2 / 3 scale scores by head_dim ** -0.5 (query_pre_attn_scalar is not
    written; llama.cpp uses head_dim below 27B); Gemma 3's global layers are every 6th (its sliding_window_pattern
    is fixed, so six layers show both kinds) and its converter refuses an attention soft cap; gpt-oss's SwiGLU clamp
    is llama.cpp's constant 7 (its graph hard-codes gpt-oss's published limit)."""
    head_dim = model_kwargs.get("head_dim", 16)
    if family == "gemma2":
        return dict(query_pre_attn_scalar=head_dim)
    if family == "gemma3":
        return dict(query_pre_attn_scalar=head_dim, num_layers=6, attn_logit_softcapping=None)
    if family == "gpt_oss":
        return dict(swiglu_limit=7.0)
    return {}


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's half-split rotary rows -> GGML's interleaved pairs (what llama.cpp's converter does for Llama)."""
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape).copy()


def build_tiny_gguf(family: str, path: str | Path, tensor_type: str = "F32", *, seed: int = 0,
                    split_max_tensors: int = 0, **model_kwargs) -> Path:
    """Write `family`'s tiny model as `path` (a .gguf file), its linears in `tensor_type`; returns the path (the
    first shard's when split_max_tensors > 0 splits it into `stem-0000i-of-0000N.gguf` files, as gguf-split does).
    The Hugging Face folder it came from is left beside it, at path.with_suffix(".hf").

    K-quants (Q4_K, Q6_K, ...) need rows of a multiple of 256: pass hidden_size / intermediate_size to match.
    The gguf package cannot quantize to them, so their blocks are random bytes with sane scales (a valid
    GGUF whose dequantized values are what both nanoinfer and transformers then run).
    """
    import gguf
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    options = {**gguf_options(family, model_kwargs), **model_kwargs}
    hf_dir = build_tiny_model(family, path.with_suffix(".hf"), seed=seed, **options)
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = {name: t.to(torch.float32).numpy() for name, t in load_file(str(hf_dir / "model.safetensors")).items()}
    arch = gguf.MODEL_ARCH[ARCHITECTURES[family]]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    _METADATA[ARCHITECTURES[family]](writer, config, _rope(config))
    _add_tokenizer(writer, hf_dir)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    for name, data in _converted(family, config, tensors):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        stored = gguf.GGMLQuantizationType[_stored_type(name, data, tensor_type)]
        _add_quantized(writer, gguf, gguf_name, data, stored, rng)
    for gguf_name, data in _extra_tensors(family, config):
        writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]


def _stored_type(name: str, data: np.ndarray, tensor_type: str) -> str:
    """The type a tensor is written in: vectors, biases (the experts' too) and MoE routers (ffn_gate_inp, which the
    converter and llama-quantize keep) F32, the embedding and head F16, every other matrix (the experts' stacks too)
    `tensor_type`; MXFP4: the experts' stacks (the only 3-D tensors) MXFP4, everything else F32."""
    if data.ndim == 1 or name.endswith(("bias", ".gate.weight", ".router.weight")):
        return "F32"
    if tensor_type == "MXFP4":
        return "MXFP4" if data.ndim == 3 else "F32"
    return "F16" if name in ("model.embed_tokens.weight", "lm_head.weight") else tensor_type


def stored_weights_folder(path: str | Path, tensor_type: str) -> Path:
    """The Hugging Face folder of the weights build_tiny_gguf(..., tensor_type) wrote to `path`: its source folder
    with each tensor quantized as written and dequantized again by the gguf package, at path.with_suffix(
    ".stored.hf"), for transformers to run what the file holds where it cannot read the file itself. Each HF
    tensor round-trips alone: the file's blocks run along rows, which stacking experts or reordering q/k rows keeps
    (gpt-oss's fused experts, [E, columns, rows], round-trip transposed). Not for K-quants (their blocks are random
    bytes)."""
    import gguf
    import torch
    from safetensors.torch import load_file, save_file

    if tensor_type in K_QUANTS:
        raise ValueError(f"{tensor_type} files hold random blocks, not quantized weights")
    path = Path(path)
    source, out = path.with_suffix(".hf"), path.with_suffix(".stored.hf")
    shutil.copytree(source, out, dirs_exist_ok=True)
    tensors = {}
    gpt_oss = json.loads((source / "config.json").read_text())["model_type"] == "gpt_oss"
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        data = tensor.to(torch.float32).numpy()
        kind = gguf.GGMLQuantizationType[_stored_type(name, data, tensor_type)]
        transposed = gpt_oss and data.ndim == 3
        if transposed:
            data = data.transpose(0, 2, 1)
        if kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(data), kind), kind)
        if transposed:
            data = data.transpose(0, 2, 1)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(tensor.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _rope(config: dict) -> dict:
    """The config's rope parameters as the converter reads them (transformers 5 nests them; Gemma 3 by layer type)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def _converted(family: str, config: dict, tensors: dict):
    """(HF name, values) of the checkpoint's tensors as the converter's modify_tensors gives them."""
    items = _stacked_experts(family, tensors).items()
    if family == "gpt_oss":
        items = [converted for name, data in items for converted in _gpt_oss_tensors(name, data)]
    for name, data in items:
        if name == "lm_head.weight" and (config.get("tie_word_embeddings") or family in ("gemma", "gemma2")):
            continue  # a tied head is the embedding; Gemma's converters drop lm_head always
        if ARCHITECTURES[family] == "LLAMA" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                               "k_proj.bias")):  # fmt: skip
            data = permute_rotary(data, config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"])
        if family.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma converters: "Gemma3RMSNorm adds 1.0 to the norm value"
        yield name, data


def _stacked_experts(family: str, tensors: dict) -> dict:
    """The checkpoint with each layer's per-expert projections stacked into one [experts, rows, columns] tensor
    per projection, under the name the converter gives it (Qwen2MoeModel's experts.gate_proj, LlamaModel's
    feed_forward.experts.w1 for Mixtral), in place of the first expert's."""
    pattern = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
    stacks: dict[str, list] = {}
    result = {}
    for name, data in tensors.items():
        match = pattern.fullmatch(name)
        if match is None:
            result[name] = data
            continue
        layer, _, proj = match.groups()
        merged = (f"layers.{layer}.feed_forward.experts.{proj}.weight" if family == "mixtral"
                  else f"model.layers.{layer}.mlp.experts.{proj}.weight")  # fmt: skip
        if merged not in stacks:
            stacks[merged] = []
            result[merged] = None  # filled below, in the first expert's place
        stacks[merged].append((int(match.group(2)), data))
    for merged, experts in stacks.items():
        result[merged] = np.stack([data for _, data in sorted(experts, key=lambda item: item[0])])
    return result


def _gpt_oss_tensors(name: str, data: np.ndarray):
    """GptOssModel's filter_tensors / modify_tensors on a float checkpoint: the sinks named `.weight`; the experts'
    [E, H, 2I] gate_up_proj transposed to [E, 2I, H] and its interleaved rows split (gate j at row 2j, up j at
    2j + 1) into gate_proj and up_proj, its bias likewise; down_proj transposed to [E, H, I]."""
    if name.endswith(".self_attn.sinks"):
        yield f"{name}.weight", data
    elif name.endswith("experts.gate_up_proj"):
        rows = data.transpose(0, 2, 1)
        yield name.replace("gate_up_proj", "gate_proj.weight"), np.ascontiguousarray(rows[:, 0::2])
        yield name.replace("gate_up_proj", "up_proj.weight"), np.ascontiguousarray(rows[:, 1::2])
    elif name.endswith("experts.gate_up_proj_bias"):
        yield name.replace("gate_up_proj_bias", "gate_proj.bias"), np.ascontiguousarray(data[:, 0::2])
        yield name.replace("gate_up_proj_bias", "up_proj.bias"), np.ascontiguousarray(data[:, 1::2])
    elif name.endswith("experts.down_proj"):
        yield f"{name}.weight", np.ascontiguousarray(data.transpose(0, 2, 1))
    elif name.endswith("experts.down_proj_bias"):
        yield name.replace("down_proj_bias", "down_proj.bias"), data
    else:
        yield name, data


def _extra_tensors(family: str, config: dict):
    """(GGUF name, float32 values) of the tensors the converter's generate_extra_tensors adds: rope scaling."""
    rope = _rope(config)
    if family == "llama" and rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(config, rope)
    if family in ("phi3", "phi4_mini") and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def llama3_rope_factors(config: dict, rope: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: one divisor of each rotary pair's frequency. (The converter reads the
    original context length from the top of config.json, 8192 when it is not there, as in Llama 3.1's.)"""
    import torch

    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = config.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


# ---- metadata, per architecture as its converter class writes it --------------------------------------------
def _text_model(writer, config: dict, rope: dict) -> None:
    """TextModel.set_gguf_parameters, the base every converter class starts from (or copies)."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if full.get("rope_type") == "yarn":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):  # fmt: skip
            if full.get(key) is not None:
                add(full[key])
    writer.add_rope_freq_base(full.get("rope_theta", rope.get("rope_theta")))
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def _qwen3moe(writer, config: dict, rope: dict) -> None:
    """Qwen3MoeModel (Qwen2MoeModel's set_gguf_parameters). llama.cpp's qwen3moe has experts in every layer and
    always renormalizes the top k, so a model that does otherwise has no faithful file: refused here."""
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1 or not config.get("norm_topk_prob"):
        raise ValueError("llama.cpp's qwen3moe runs experts in every layer with the top-k weights renormalized: build "
                         "the model with mlp_only_layers=[], decoder_sparse_step=1 and norm_topk_prob=True")
    _text_model(writer, config, rope)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _llama(writer, config: dict, rope: dict) -> None:
    _text_model(writer, config, rope)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _gemma(writer, config: dict, rope: dict) -> None:
    """GemmaModel.set_gguf_parameters (no rope base: llama.cpp's default 10000 is Gemma's)."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])


def _gemma2(writer, config: dict, rope: dict) -> None:
    _gemma(writer, config, rope)
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _gemma3(writer, config: dict, rope: dict) -> None:
    _text_model(writer, config, rope)
    if config.get("attn_logit_softcapping") is not None:  # as the converter, which refuses it
        raise ValueError("llama.cpp writes no attention soft cap for Gemma 3 (removed in Gemma 3): build the model "
                         "without attn_logit_softcapping")
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _phi3(writer, config: dict, rope: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters; the longrope factors are tensors (_extra_tensors)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    original = config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)  # 0 tells Phi-4 (no window) apart
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _gpt_oss(writer, config: dict, rope: dict) -> None:
    """GptOssModel.set_gguf_parameters: TextModel's keys (YaRN's included), the window and the experts' width. Its
    layer pattern (sliding from layer 0, every other one) is llama.cpp's fixed one: a model that differs is refused."""
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config["num_hidden_layers"])]
    if config.get("layer_types", expected) != expected:
        raise ValueError("llama.cpp's gpt-oss slides its window on even layers and attends fully on odd ones: build "
                         "the model with that layer_types")
    _text_model(writer, config, rope)
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])


_METADATA = {"LLAMA": _llama, "QWEN2": _text_model, "QWEN3": _text_model, "GEMMA": _gemma, "GEMMA2": _gemma2,
             "GEMMA3": _gemma3, "PHI3": _phi3, "OLMO2": _text_model, "QWEN3MOE": _qwen3moe,
             "GPT_OSS": _gpt_oss}  # fmt: skip


def _add_quantized(writer, gguf, name: str, data: np.ndarray, qtype, rng) -> None:
    if qtype.name in K_QUANTS:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(*data.shape[:-1], data.shape[-1] // block_elems * block_bytes), dtype=np.uint8)
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
