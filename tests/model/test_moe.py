"""Mixture-of-experts pieces beyond the family comparisons (test_families.py): routing equal to transformers' routers
(ties included), both checkpoint layouts of the experts, and the MoE shape ModelSpec and plan-memory report."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nanoinfer import LLM, SamplingParams
from nanoinfer.models.layers.moe import select_experts
from nanoinfer.testing.hf_reference import hf_greedy_logprobs
from nanoinfer.testing.tiny_models import build_tiny_model


def _router_cases():
    """Router logits with exact ties at the top-k boundary (three equal best experts, k = 2) and random ones."""
    torch.manual_seed(0)
    random_logits = torch.randn(64, 16)
    tied = torch.randn(64, 16)
    tied[:, [1, 5, 9]] = tied.max(dim=1, keepdim=True).values + 1.0
    return {"random": random_logits, "tied": tied}


@pytest.mark.parametrize("case", ["random", "tied"])
def test_select_experts_equals_transformers_routers(case):
    """Each router's (weights, experts) from the same logits: transformers' Qwen3-MoE, Mixtral and gpt-oss routers
    (fed the logits through an identity weight), ours by select_experts."""
    import transformers

    logits = _router_cases()[case]
    e = logits.shape[1]
    common = dict(hidden_size=e, num_experts_per_tok=2)
    routers = {
        ("softmax", True): transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
            transformers.Qwen3MoeConfig(num_experts=e, norm_topk_prob=True, **common)),
        ("softmax", False): transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
            transformers.Qwen3MoeConfig(num_experts=e, norm_topk_prob=False, **common)),
        ("topk_softmax", True): transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(
            transformers.GptOssConfig(num_local_experts=e, **common)),
        ("mixtral", True): transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
            transformers.MixtralConfig(num_local_experts=e, **common)),
    }  # fmt: skip
    for (scoring, renormalize), router in routers.items():
        with torch.no_grad():
            router.weight.copy_(torch.eye(e))
            if getattr(router, "bias", None) is not None:
                router.bias.zero_()
            _, want_weights, want_ids = router(logits)
        weights, ids = select_experts(logits, 2, "softmax" if scoring == "mixtral" else scoring, renormalize)
        assert torch.equal(ids, want_ids), (scoring, renormalize)
        torch.testing.assert_close(weights, want_weights.float(), rtol=0, atol=0)
    if case == "tied":  # the boundary really is a tie: two of the three equal experts, chosen in torch.topk's order
        assert set(ids.flatten().tolist()) <= {1, 5, 9}


def test_tied_router_rows_choose_experts_as_transformers(tmp_path):
    """A tiny Qwen3-MoE whose router gives three experts the same, winning score (identical, scaled-up rows):
    every token's top 2 is two of the three, picked by the tie rule, and greedy output still equals transformers."""
    from safetensors import safe_open

    path = build_tiny_model("qwen3_moe", tmp_path / "tied")
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensor[[3, 5, 6]] = 4 * tensor[3]
    save_file(tensors, str(file), metadata={"format": "pt"})
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 120)]
    expected, expected_logprobs = hf_greedy_logprobs(path, prompts, 16)
    llm = LLM(str(path), dtype="float32", cpu_kvcache_space_gib=0.25, max_model_len=256)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1))
    for out, ref, ref_logprobs in zip(outputs, expected, expected_logprobs):
        assert out.token_ids == ref
        worst = max(abs(entry.logprob - want) for entry, want in zip(out.outputs[0].logprobs, ref_logprobs))
        assert worst < 2e-4  # float32 summation order only, as test_families.py's bound


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and the
    published per-expert one give the same model."""
    import transformers

    per_expert = build_tiny_model("qwen3_moe", tmp_path / "per_expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)  # the fused layout, as transformers holds it
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / extra).write_bytes((per_expert / extra).read_bytes())
    prompts = [[7, 8, 9, 10, 11], list(range(3, 60))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [LLM(str(p), dtype="float32", cpu_kvcache_space_gib=0.1, max_model_len=128).generate(prompts, params)
            for p in (per_expert, fused)]  # fmt: skip
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_model_spec_counts_every_expert(tmp_path):
    """ModelSpec's MoE shape: all experts' parameters in the layers, apart from the dense matmuls."""
    from nanoinfer.models.config import load_hf_config
    from nanoinfer.models.registry import model_spec

    path = build_tiny_model("qwen3_moe", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    spec = model_spec(load_hf_config(str(path)))
    hidden, width, experts = config["hidden_size"], config["moe_intermediate_size"], config["num_local_experts"]
    assert (spec.num_moe_layers, spec.num_experts, spec.experts_per_token) == (2, experts, 2)
    assert spec.params_per_expert == 3 * hidden * width
    assert spec.expert_params == 2 * experts * 3 * hidden * width
    assert spec.layer_params > spec.expert_params + experts * hidden * 2  # + routers, attention, norms


QWEN3_30B_A3B = Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3-30b-a3b"
# Qwen3-30B-A3B by hand, a layer: attention 2048 x (4096 + 512 + 512) + 4096 x 2048 and q/k norms 2 x 128; the router
# 128 x 2048; 128 experts of 3 x 2048 x 768; two norms of 2048. Then embedding and LM head 151936 x 2048 each and the
# final norm.
_LAYER = 2048 * 5120 + 4096 * 2048 + 256 + 128 * 2048 + 128 * 3 * 2048 * 768 + 2 * 2048
QWEN3_30B_A3B_PARAMS = 48 * _LAYER + 2 * 151936 * 2048 + 2048  # 30,532,122,624


def test_plan_memory_holds_every_expert_of_qwen3_30b_a3b():
    from typer.testing import CliRunner

    from nanoinfer.cli import app

    result = CliRunner().invoke(app, ["plan-memory", "--model", str(QWEN3_30B_A3B), "--gpu", "H200", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["weights_bytes"] == 2 * QWEN3_30B_A3B_PARAMS == 61_064_245_248
    assert report["moe"] == "48 layers x 128, top 8"
    assert report["expert_bytes"] == round(2 * QWEN3_30B_A3B_PARAMS * (48 * 128 * 3 * 2048 * 768)
                                           / QWEN3_30B_A3B_PARAMS)  # fmt: skip
    result = CliRunner().invoke(app, ["plan-memory", "--model", str(QWEN3_30B_A3B), "--gpu", "L4"])
    assert "of which the experts 54.0 GiB (48 layers x 128 experts)" in result.output


def test_check_config_says_when_the_experts_do_not_fit_in_ram(tmp_path):
    """A checkpoint whose safetensors headers add up to more than the machine's RAM is refused before loading,
    naming the experts' share; the header alone is read (this file has no tensor data)."""
    from typer.testing import CliRunner

    from nanoinfer.cli import app

    (tmp_path / "config.json").write_text((QWEN3_30B_A3B / "config.json").read_text())
    header = json.dumps({name: {"dtype": "BF16", "shape": [128, 3 * 2048 * 768], "data_offsets": [0, 0]}
                         for name in (f"model.layers.{i}.mlp.experts.w{i}" for i in range(48))} |
                        {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [1 << 20, 1 << 19],
                                                       "data_offsets": [0, 0]}}).encode()  # fmt: skip
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    result = CliRunner().invoke(app, ["check-config", "--model", str(tmp_path), "--device", "cpu",
                                      "--dtype", "float32"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "more than this machine's RAM" in result.output
    assert "of which the experts" in result.output and "Use dtype: bfloat16" in result.output
    assert "Traceback" not in result.output


def test_tensor_parallel_size_must_divide_the_expert_width(tmp_path):
    from nanoinfer import Config
    from nanoinfer.errors import ConfigError

    path = build_tiny_model("qwen3_moe", tmp_path / "m", moe_intermediate_size=36, num_heads=4, num_kv_heads=4)
    with pytest.raises(ConfigError) as info:
        Config(model=str(path), device="cpu", tensor_parallel_size=8)
    assert "each expert's width (36" in str(info.value) and "Use one of 1, 2, 3, 4, 6" in str(info.value)


def test_check_config_names_the_experts(tmp_path):
    from typer.testing import CliRunner

    from nanoinfer.cli import app

    path = build_tiny_model("qwen3_moe", tmp_path / "m")
    result = CliRunner().invoke(app, ["check-config", "--model", str(path), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "8 experts in 2 layers (top 2)" in " ".join(result.output.split())  # rich wraps the line
