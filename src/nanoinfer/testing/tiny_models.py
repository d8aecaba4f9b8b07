"""Tiny random-weight models of every supported family (TINY_FAMILIES), built with transformers' own classes and
saved as normal Hugging Face folders (config.json, model.safetensors, a real BPE tokenizer with a chat template).
No download: the tokenizer is trained here on a small built-in corpus. Fast enough for every engine test.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = """The quick brown fox jumps over the lazy dog. Paris is the capital of France; Berlin is the capital
of Germany and Rome the capital of Italy. A paged KV cache stores keys and values in fixed-size blocks.
Continuous batching admits new requests as soon as old ones finish. Prefix caching reuses the blocks of a
shared prompt. Tensor parallelism splits the weights of each layer across devices. Numbers: 0 1 2 3 4 5 6
7 8 9 10 100 1000. Once upon a time there was a small language model that wanted to answer questions.
def main(): print("hello world") # code, json {"key": [1, 2, 3]} and punctuation !?;:'"()[]{}<>
""" * 4

# A Qwen3 / DeepSeek-R1 style template for the "thinking" tokenizer: tools listed in a system turn, the generation
# prompt opening the thinking unless enable_thinking is false (which closes an empty one), as those templates do.
THINKING_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    + CHAT_TEMPLATE.removesuffix("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    + "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
THINKING_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def build_tokenizer(vocab_size: int = 512, thinking: bool | str = False):
    """A BPE tokenizer trained on CORPUS; `thinking`: with <think> / </think> / <tool_call> / </tool_call> as tokens
    of their own (not special: they stay in decoded text, as Qwen3's; "special": special ones, which decoding with
    skip_special_tokens leaves out, as some models mark them) and THINKING_CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    if thinking:
        fast.add_tokens(THINKING_TOKENS, special_tokens=thinking == "special")
        fast.chat_template = THINKING_CHAT_TEMPLATE
    return fast


def build_tiny_model(family: str, path: str | Path, *, num_layers: int = 2, hidden_size: int = 64,
                     num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                     max_position_embeddings: int = 2048, tie_word_embeddings: bool | None = None,
                     seed: int = 0, thinking: bool | str = False, **options) -> Path:
    """Save a random-weight model of `family` (a key of TINY_FAMILIES) to `path` and return it. `options` are
    config fields that replace the family's own test options (e.g. sliding_window). `thinking`: the tokenizer and
    chat template of a model that thinks first and calls tools (build_tokenizer).

    Weights are drawn with a larger std than HF's default so that logits are spread out: near-ties
    between the top two tokens would make greedy comparisons depend on float rounding.
    """
    import torch
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {', '.join(TINY_FAMILIES)}")
    path = Path(path)
    tokenizer = build_tokenizer(thinking=thinking)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        initializer_range=0.1,
    )
    config_class, model_class, family_options, tied_by_default = TINY_FAMILIES[family]
    tied = tied_by_default if tie_word_embeddings is None else tie_word_embeddings
    family_values = family_options(num_layers)
    if "text_config" in family_values:  # a vision-language checkpoint (Gemma 3): the decoder is its text_config
        text = {**common, **family_values["text_config"], **options, "tie_word_embeddings": tied}
        values = {**family_values, "text_config": text, "tie_word_embeddings": tied}
    else:
        values = {**common, **family_values, **options, "tie_word_embeddings": tied}
    config = getattr(transformers, config_class)(**values)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm scales by w, whatever the family's norms
                param.normal_(1.0, 0.1)
            elif name.endswith("norm.weight"):
                # Gemma's norms scale by 1 + w: centre theirs on 0 so every family's scale is about 1.
                param.normal_(0.0 if config_class.startswith(_PLUS_ONE_NORMS) else 1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4 MoE's router scales: 1 at init only
                param.uniform_(0.5, 1.5)
            elif name.endswith("self_attn.sinks"):  # gpt-oss's sink logits: as large as the tiny model's scores
                param.normal_(0.0, 2.0)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale: 1 at init only
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _no_options(num_layers: int) -> dict:
    return {}


# Config classes whose norms scale by 1 + w (Gemma 1-3, Qwen3-Next, Qwen3.5); Gemma 4's scale by w, as the others'.
_PLUS_ONE_NORMS = ("GemmaConfig", "Gemma2Config", "Gemma3Config", "Gemma3TextConfig", "Qwen3NextConfig", "Qwen3_5")


# family -> (transformers config class, model class, the options its published checkpoints set, in a form a test's
# prompts exercise (a window shorter than the prompts, soft caps on, ...), tied embeddings by default)
TINY_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _no_options, False),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _no_options, True),
    "llama": ("LlamaConfig", "LlamaForCausalLM", lambda n: dict(rope_theta=100000.0), False),
    "mistral": ("MistralConfig", "MistralForCausalLM", lambda n: dict(sliding_window=24), False),
    # Qwen3 with use_sliding_window (off in published checkpoints): windows on layers from max_window_layers on
    "qwen3_window": ("Qwen3Config", "Qwen3ForCausalLM",
                     lambda n: dict(use_sliding_window=True, sliding_window=24, max_window_layers=1), False),
    # Gemma 1: MQA (gemma-2b) and a head_dim other than hidden_size / heads (gemma-7b)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", lambda n: dict(num_key_value_heads=1, head_dim=32), True),
    # soft caps of 1.5 (attention) and 3 (final) bite on the tiny model's scores (up to ~3) and logits (~2.6 max)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               lambda n: dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                              final_logit_softcapping=3.0),
               True),  # fmt: skip
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", lambda n: _gemma3_options(n), True),
    # a vision-language checkpoint (language_model.model.* beside a one-layer SigLIP tower), run for its text part
    "gemma3_multimodal": ("Gemma3Config", "Gemma3ForConditionalGeneration",
                          lambda n: dict(text_config=_gemma3_options(n), mm_tokens_per_image=1,
                                         vision_config=dict(model_type="siglip_vision_model", hidden_size=16,
                                                            intermediate_size=32, num_hidden_layers=1,
                                                            num_attention_heads=2, image_size=28, patch_size=14)),
                          True),  # fmt: skip
    # Phi-3.5 / Phi-4-mini: longrope switching at 620, the longest test prompt (tests/model/test_families.py), so
    # that every prompt fits the short factors and the shared-prefix prompts decode across the switch
    "phi3": ("Phi3Config", "Phi3ForCausalLM", lambda n: _phi3_options(rotary_dim=16, sliding_window=40), False),
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM",
                  lambda n: dict(_phi3_options(rotary_dim=12, sliding_window=262144), partial_rotary_factor=0.75),
                  True),  # fmt: skip
    # a NoPE layer (no_rope_layers 0) every other layer, there with a window
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                lambda n: dict(no_rope_layers=[int(i % 2 == 0) for i in range(n)], use_sliding_window=True,
                               sliding_window=32),
                True),  # fmt: skip
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _no_options, False),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", lambda n: _olmo3_options(n), False),
    # Qwen3-30B-A3B's options: experts in every layer, the top-k renormalized; 8 experts of width 32, top 2
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  lambda n: dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                 decoder_sparse_step=1, mlp_only_layers=[]),
                  False),  # fmt: skip
    # the other options: a dense layer among sparse ones (mlp_only_layers, decoder_sparse_step) and raw top-k weights
    "qwen3_moe_mixed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        lambda n: dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                       norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0]),
                        False),  # fmt: skip
    # Mixtral 8x7B's: 8 experts, top 2, no window
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                lambda n: dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=None),
                False),  # fmt: skip
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", lambda n: _gemma4_options(n), True),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", lambda n: _gpt_oss_options(n), False),
    # the MoE variant (26B-A4B): experts beside every dense MLP; 8 experts of width 32, top 2
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                   lambda n: dict(_gemma4_options(n), enable_moe_block=True, num_experts=8, top_k_experts=2,
                                  moe_intermediate_size=32),
                   True),  # fmt: skip
    # hybrid linear attention: Gated DeltaNet layers among gated attention ones, experts plus a shared expert (one
    # dense layer among them, as mlp_only_layers allows)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   lambda n: dict(_hybrid_options(n), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                                  mlp_only_layers=[1]),
                   False),  # fmt: skip
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", lambda n: _hybrid_options(n), True),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    lambda n: dict(_hybrid_options(n), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48),
                    False),  # fmt: skip
    # the form Qwen publishes: model.language_model.* beside model.visual.*, run for its text part
    "qwen3_5_multimodal": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                           lambda n: dict(text_config=_hybrid_options(n),
                                          vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                             out_hidden_size=64, patch_size=14,
                                                             num_position_embeddings=16)),
                           True),  # fmt: skip
    # the published checkpoints' form: language_model.* beside a vision and an audio tower, run for its text part
    "gemma4_multimodal": ("Gemma4Config", "Gemma4ForConditionalGeneration",
                          lambda n: dict(text_config=_gemma4_options(n),
                                         vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                            num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                                            position_embedding_size=64),
                                         audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                           subsampling_conv_channels=[4, 4], output_proj_dims=16)),
                          True),  # fmt: skip
}


def _gemma3_options(num_layers: int) -> dict:
    """Sliding layers with a global one every 6th and last (5 : 1 published), the local rope base on sliding layers
    and linear scaling on the global ones (gemma-3-4b and up). Both soft caps are set although published configs
    leave them None: transformers applies Gemma3ForCausalLM's final one and never the attention one, and so must we."""
    layer_types = ["full_attention" if (i + 1) % 6 == 0 or i == num_layers - 1 else "sliding_attention"
                   for i in range(num_layers)]  # fmt: skip
    rope = {
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
    }
    return dict(layer_types=layer_types, sliding_window=24, query_pre_attn_scalar=24, rope_parameters=rope,
                attn_logit_softcapping=1.5, final_logit_softcapping=3.0)


def _phi3_options(rotary_dim: int, sliding_window: int) -> dict:
    """longrope with distinct short and long factors (one per rotated pair), head_dim 16."""
    pairs = rotary_dim // 2
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(pairs)],
                long_factor=[1.5 + 0.5 * i for i in range(pairs)])  # fmt: skip
    # original_max_position_embeddings is a Phi3Config field: a value inside rope_parameters is overwritten by it
    return dict(rope_parameters=rope, original_max_position_embeddings=620, sliding_window=sliding_window)


def _olmo3_options(num_layers: int) -> dict:
    """Sliding layers with one full-attention layer every other layer (every 4th published), YaRN on the full
    ones only (as the long-context checkpoints)."""
    layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)]
    rope = {
        "sliding_attention": dict(rope_type="default", rope_theta=500000.0),
        "full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=256),
    }
    return dict(layer_types=layer_types, sliding_window=32, rope_parameters=rope)


def _gemma4_options(num_layers: int) -> dict:
    """All that Gemma 4's dense checkpoints set, in one model (E2B / E4B: per-layer input embeddings, the last layers
    reading earlier layers' keys and values with double-wide MLPs; 31B: values equal keys and fewer KV heads on
    global layers; all: wider global heads with proportional rope, a window, the final soft cap). Sliding layers
    with a global one every 3rd and last (4 : 1 and 5 : 1 published); at least 5 layers, so that a sliding and a
    global layer each share their cache with a later one."""
    n = max(num_layers, 5)
    layer_types = ["full_attention" if (i + 1) % 3 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    rope = {
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1000000.0),
    }
    return dict(num_hidden_layers=n, layer_types=layer_types, sliding_window=24, rope_parameters=rope,
                global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=512,  # the tiny tokenizer's vocabulary (build_tokenizer)
                final_logit_softcapping=3.0)


def _hybrid_options(num_layers: int) -> dict:
    """Qwen3-Next's and Qwen3.5's: linear-attention layers (2 key heads, each serving 2 of 4 value heads, as the
    published 16 : 32; a 4-tap convolution) with a gated attention layer between them, so the last layer is a linear
    one; rotary on half of each head (a quarter published); at least 3 layers."""
    n = max(num_layers, 3)
    layer_types = ["full_attention" if i % 3 == 1 else "linear_attention" for i in range(n)]
    return dict(num_hidden_layers=n, layer_types=layer_types, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))


def _gpt_oss_options(num_layers: int) -> dict:
    """gpt-oss-20b's options: sliding and full layers alternating, YaRN as published (factor 32 over 4096 positions,
    not truncated), the router's top 2 of 8 experts (4 of 32 published) of width 32; the SwiGLU clamp at 1 rather than
    7, so that it bites on the tiny model's projections (about +-1)."""
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                original_max_position_embeddings=4096)  # fmt: skip
    return dict(layer_types=layer_types, sliding_window=24, rope_parameters=rope, num_local_experts=8,
                num_experts_per_tok=2, intermediate_size=32, swiglu_limit=1.0, attention_bias=True,
                max_position_embeddings=131072)  # 32 x 4096, as YaRN's factor says
