"""gpt-oss checkpoints as published: the experts in MXFP4 (`*_blocks` / `*_scales`), dequantized at load. The tiny
model's expert weights are rounded to values MXFP4 holds exactly, so the MXFP4 copy and the float copy are one model:
greedy tokens from the MXFP4 folder equal transformers' on the float one. (test_families.py checks the family on the
float layout in its four regimes.)"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoinfer import LLM, SamplingParams
from nanoinfer.errors import ModelLoadError
from nanoinfer.models.gpt_oss import FP4_VALUES, dequantize_mxfp4
from nanoinfer.testing.hf_reference import hf_greedy
from nanoinfer.testing.tiny_models import build_tiny_model

NUM_TOKENS = 16
_MAGNITUDES = torch.tensor(FP4_VALUES[:8])  # the codes 0-7; 8-15 are their negatives


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, C] float (C a multiple of 32) -> (blocks [E, R, C / 32, 16] uint8, scales [E, R, C / 32] uint8): each
    block of 32 scaled by the power of two that brings its largest magnitude to at most 6, each value rounded to the
    nearest code. The inverse of dequantize_mxfp4 for values it holds exactly."""
    groups = weight.float().unflatten(-1, (-1, 32))  # [E, R, G, 32]
    peak = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(peak / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - _MAGNITUDES).abs().argmin(-1)  # nearest of the 8 magnitudes
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def round_to_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """weight [E, R, C] with each value the nearest MXFP4 holds (in the blocks of 32 along C)."""
    return dequantize_mxfp4(*quantize_mxfp4(weight))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float folder, MXFP4 folder) of one tiny gpt-oss whose expert weights MXFP4 holds exactly. The MXFP4 tensors
    are split over two files so that some blocks are read before their scales and some after."""
    root = tmp_path_factory.mktemp("gpt-oss")
    source = build_tiny_model("gpt_oss", root / "source")
    tensors = load_file(source / "model.safetensors")
    float_dir, mxfp4_dir = root / "float", root / "mxfp4"
    for folder in (float_dir, mxfp4_dir):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    first, second = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            # transformers' layouts [E, H, 2I] and [E, I, H]; MXFP4 stores them transposed, 32 inputs a block
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
            tensors[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
            gate_up = name.endswith("gate_up_proj")
            (second if gate_up else first)[name + "_blocks"] = blocks
            (first if gate_up else second)[name + "_scales"] = scales
        else:
            first[name] = tensor
    save_file(tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(first, mxfp4_dir / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, mxfp4_dir / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}  # as published
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    return float_dir, mxfp4_dir


def test_mxfp4_dequantizes_as_transformers_reads_it():
    """Our reading of the blocks and scales is transformers' (integrations/mxfp4.py), which returns the [E, C, R]
    layout GptOssExperts multiplies by."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 134, (3, 8, 2), dtype=torch.uint8, generator=gen)
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales), expected.transpose(1, 2), rtol=0, atol=0)


def test_quantize_round_trips_values_mxfp4_holds():
    weight = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    rounded = round_to_mxfp4(weight)
    assert not torch.equal(rounded, weight)
    assert torch.equal(round_to_mxfp4(rounded), rounded)
    assert (rounded - weight).abs().max() <= weight.abs().max() / 6  # half a step of the coarsest block, at most


def test_mxfp4_checkpoint_gives_the_float_models_tokens(checkpoints):
    float_dir, mxfp4_dir = checkpoints
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 12, 30, 47, 90)]  # within and past the window
    expected, _ = hf_greedy(float_dir, prompts, NUM_TOKENS)
    assert len({tuple(tokens) for tokens in expected}) == len(prompts)  # the rounded model still tells prompts apart
    llm = LLM(str(mxfp4_dir), dtype="float32", max_model_len=256, device="cpu", cpu_kvcache_space_gib=0.05)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [out.token_ids for out in outputs] == expected


def test_mxfp4_blocks_without_their_scales_are_reported(checkpoints, tmp_path):
    """A checkpoint missing one half of an MXFP4 pair fails the load, naming the expert weights left unfilled."""
    _, mxfp4_dir = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(mxfp4_dir, broken)
    second = broken / "model-00002-of-00002.safetensors"
    tensors = load_file(second)
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, second, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing weights: .*model\.layers\.0\.mlp\.experts\.w2_weight"):
        LLM(str(broken), dtype="float32", max_model_len=256, device="cpu", cpu_kvcache_space_gib=0.05)


def test_memory_counts_mxfp4_experts_as_the_values_they_hold(checkpoints):
    """plan-memory and the CPU RAM check read headers: MXFP4 blocks hold two values a byte, their scales none."""
    from nanoinfer import memory
    from nanoinfer.models.config import load_hf_config
    from nanoinfer.models.registry import model_spec

    float_dir, mxfp4_dir = checkpoints
    spec = model_spec(load_hf_config(str(float_dir)))
    want = memory.weights_bytes_from_checkpoint(float_dir, "bfloat16", spec)
    assert memory.weights_bytes_from_checkpoint(mxfp4_dir, "bfloat16", spec) == want
