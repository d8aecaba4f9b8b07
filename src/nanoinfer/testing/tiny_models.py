"""Tiny random-weight Qwen3 / Qwen2 / Llama models, built with transformers' own classes and saved as
normal Hugging Face folders (config.json, model.safetensors, a real BPE tokenizer with a chat template).
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

_FAMILIES = ("qwen3", "qwen2", "llama")


def build_tokenizer(vocab_size: int = 512):
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
    return fast


def build_tiny_model(family: str, path: str | Path, *, num_layers: int = 2, hidden_size: int = 64,
                     num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                     max_position_embeddings: int = 2048, tie_word_embeddings: bool | None = None,
                     seed: int = 0) -> Path:
    """Save a random-weight model of `family` (qwen3 | qwen2 | llama) to `path` and return it.

    Weights are drawn with a larger std than HF's default so that logits are spread out: near-ties
    between the top two tokens would make greedy comparisons depend on float rounding.
    """
    import torch
    import transformers

    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {_FAMILIES}")
    path = Path(path)
    tokenizer = build_tokenizer()
    vocab_size = len(tokenizer)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        initializer_range=0.1,
    )
    if family == "qwen3":
        config = transformers.Qwen3Config(head_dim=head_dim, tie_word_embeddings=bool(tie_word_embeddings), **common)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen2":
        tied = True if tie_word_embeddings is None else tie_word_embeddings
        config = transformers.Qwen2Config(tie_word_embeddings=tied, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(head_dim=head_dim, tie_word_embeddings=bool(tie_word_embeddings),
                                          rope_theta=100000.0, **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
