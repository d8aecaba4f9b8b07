"""The built-in default model, loaded by transformers (the reference), answers a factual question."""

import pytest
import torch
from transformers import AutoTokenizer

from nanoinfer.testing.hf_reference import hf_model


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = hf_model(default_model_dir, torch.float32)  # its GGUF, through transformers' own GGUF loader
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
