"""bench.random_weight_model: random weights for a config-only folder, written shard by shard, that transformers and
nanoinfer both load (a mixture of experts included: the experts under transformers' fused names)."""

from __future__ import annotations

import json

import torch

from nanoinfer import bench
from nanoinfer.testing.tiny_models import build_tiny_model


def test_random_weights_load_in_transformers_and_nanoinfer(tmp_path, monkeypatch):
    import transformers

    from nanoinfer import LLM, SamplingParams

    tiny = build_tiny_model("qwen3_moe", tmp_path / "tiny")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny / "config.json").read_text())
    monkeypatch.setattr(bench, "RANDOM_SHARD_BYTES", 64 << 10)  # several shards from a tiny model
    folder = bench.random_weight_model(config_only, "float32", cache_dir=tmp_path / "cache")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].std() > 0.5 * 0.1  # initializer_range 0.1, not zeros
    assert torch.equal(state["model.norm.weight"], torch.ones_like(state["model.norm.weight"]))
    out = LLM(str(folder), dtype="float32", cpu_kvcache_space_gib=0.1, max_model_len=64).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ids = torch.tensor([[5, 6, 7]])
    want = model.generate(ids, max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    assert out[0].token_ids == want
