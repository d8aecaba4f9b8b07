"""GGUF files as a weight format: tiny random models written with the `gguf` package as llama.cpp's converter
writes each architecture, in every tensor type nanoinfer loads, run from the .gguf file itself; greedy float32
tokens equal transformers' on the same file (its own GGUF loader, dequantizing with the gguf package) and the
Hugging Face folder each file came from. Llama 3's rope scaling comes back from its rope_freqs tensor, split
files load from their shards, Q4_0 / Q4_1 blocks reach the CPU 4-bit GEMM as they are, MoE files (qwen3moe,
Mixtral as a llama with experts, gpt-oss with its sinks, biases, YaRN and MXFP4 experts) load their stacked expert
tensors; unsupported types and architectures, missing shards and missing or mis-shaped expert (or sink) tensors are
clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from nanoinfer import LLM, SamplingParams
from nanoinfer.cli import app
from nanoinfer.errors import ModelLoadError, NanoInferError
from nanoinfer.models.gpt_oss import dequantize_mxfp4
from nanoinfer.models.llama import llama3_rope_scaling
from nanoinfer.models.weights import gguf as gguf_format
from nanoinfer.platforms.cpu import linear as cpu_linear
from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.testing.hf_reference import hf_greedy, hf_model
from nanoinfer.testing.tiny_gguf import (
    ARCHITECTURES,
    LLAMA3_ROPE,
    build_tiny_gguf,
    llama3_rope_factors,
    stored_weights_folder,
)

NUM_TOKENS = 12
K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
CASES = [(family, kind) for family in ("qwen3", "llama") for kind in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")]
CASES += [("qwen2", "Q4_1"), ("qwen2", "Q8_0"), ("llama", "Q4_K"), ("qwen3", "Q6_K"), ("qwen2", "Q4_K")]
# The families llama.cpp writes its own way (Gemma's norms stored as 1 + w, sandwich norms, Phi-3's fused
# projections and longrope tensors, partial rotary, OLMo 2's post-norms): float32 files equal their HF folder,
# quantized ones transformers on the same file where it reads the architecture.
FAMILY_CASES = [(family, "F32") for family in ("gemma", "gemma2", "gemma3", "phi3", "phi4_mini", "olmo2")]
FAMILY_CASES += [("phi3", "Q4_0"), ("gemma3", "Q8_0")]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    threads = torch.get_num_threads()
    yield tmp_path_factory.mktemp("gguf")
    torch.set_num_threads(threads)


def build(gguf_dir, family: str, kind: str):
    shape = K_QUANT_SHAPE if kind.endswith("_K") else {}
    if kind.endswith("_K") and family == "qwen3_moe":
        shape = dict(shape, moe_intermediate_size=256)  # the down experts' rows too
    folder = gguf_dir / f"{family}-{kind}"
    folder.mkdir(exist_ok=True)
    return build_tiny_gguf(family, folder / "model.gguf", kind, **shape)


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 17, 40)]


def run(path, **kwargs) -> tuple[LLM, list[list[int]], list[list[int]]]:
    """The LLM on `path`, the test prompts and its greedy tokens for them."""
    llm = LLM(str(path), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02, **kwargs)
    ids = prompts(llm.config.hf_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return llm, ids, [o.token_ids for o in llm.generate(ids, params)]


def run_family(gguf_dir, family: str, kind: str):
    """(path, llm, ids, ours) of the family's file of `kind`: it runs as the architecture its source folder names,
    and a float32 file gives that folder's tokens (its weights are the folder's)."""
    path = build(gguf_dir, family, kind)
    llm, ids, ours = run(path)
    source = json.loads((path.with_suffix(".hf") / "config.json").read_text())
    assert llm.config.hf_config.architectures == source["architectures"]
    if kind == "F32":
        assert ours == hf_greedy(path.with_suffix(".hf"), ids, NUM_TOKENS)[0]
    return path, llm, ids, ours


def assert_transformers_on_the_file_agrees(path, llm, ids, ours) -> None:
    """transformers' own GGUF loader on the same file gives our tokens; its config comes from the source folder
    (transformers' GGUF mapping leaves out e.g. a Qwen3 head_dim other than 128)."""
    config = transformers.AutoConfig.from_pretrained(path.with_suffix(".hf"))
    assert ours == hf_greedy(llm.config.model, ids, NUM_TOKENS, config=config)[0]


def transformers_reads(family: str) -> bool:
    """Whether transformers' own GGUF loader reads the family's llama.cpp architecture (not gemma, olmo2)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return ARCHITECTURES[family].lower() in GGUF_SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize("family, kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_gguf_greedy_tokens_equal_transformers_on_the_same_file(gguf_dir, family, kind):
    path = build(gguf_dir, family, kind)
    llm, ids, ours = run(path)
    assert llm.config.hf_config.model_type == family
    assert_transformers_on_the_file_agrees(path, llm, ids, ours)


@pytest.mark.parametrize("family, kind", FAMILY_CASES, ids=[f"{f}-{k}" for f, k in FAMILY_CASES])
def test_family_gguf_greedy_tokens_equal_its_hf_folder_and_transformers(gguf_dir, family, kind):
    path, llm, ids, ours = run_family(gguf_dir, family, kind)  # F32: Gemma's 1 + w - 1 is exact
    if transformers_reads(family):
        assert_transformers_on_the_file_agrees(path, llm, ids, ours)


def test_a_llama3_gguf_gets_its_rope_scaling_back_from_rope_freqs(gguf_dir):
    folder = gguf_dir / "llama3"
    folder.mkdir()
    path = build_tiny_gguf("llama", folder / "model.gguf", rope_parameters=LLAMA3_ROPE,
                           max_position_embeddings=131072)  # fmt: skip
    llm, ids, ours = run(path)
    scaling = json.loads((Path(llm.config.model) / "config.json").read_text())["rope_scaling"]
    assert scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}  # the folder's, exactly
    assert ours == hf_greedy(path.with_suffix(".hf"), ids, NUM_TOKENS)[0]


def test_a_yarn_gguf_gets_its_rope_scaling_back_from_the_metadata(gguf_dir):
    # TextModel's keys: type, factor, original context, beta_fast / beta_slow where the config sets them
    folder = gguf_dir / "yarn"
    folder.mkdir()
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=16.0,
                beta_slow=2.0)  # fmt: skip
    path = build_tiny_gguf("qwen3", folder / "model.gguf", rope_parameters=yarn, max_position_embeddings=256)
    llm, ids, ours = run(path)
    scaling = json.loads((Path(llm.config.model) / "config.json").read_text())["rope_scaling"]
    assert scaling == {k: v for k, v in yarn.items() if k != "rope_theta"}
    assert ours == hf_greedy(path.with_suffix(".hf"), ids, NUM_TOKENS)[0]


@pytest.mark.parametrize("low, high, head_dim", [(1.0, 4.0, 128), (1.0, 16.0, 128), (2.0, 8.0, 128), (1.0, 8.0, 16)])
def test_llama3_rope_parameters_are_solved_from_rope_freqs(low, high, head_dim):
    # Llama 3's (1, 4) directly; others solved from the blended pairs (one pair alone: low taken as 1)
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=low, high_freq_factor=high)
    factors = llama3_rope_factors({"head_dim": head_dim}, rope)
    assert llama3_rope_scaling(factors, 500000.0, 8192) == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    assert llama3_rope_scaling(np.array([1.0, 3.0, 2.0, 8.0], dtype=np.float32), 500000.0, 8192) is None


def test_a_split_gguf_loads_from_its_shards_and_a_missing_shard_is_named(gguf_dir, tmp_path):
    folder = tmp_path / "split"
    folder.mkdir()
    first = build_tiny_gguf("qwen3", folder / "model.gguf", "Q8_0", split_max_tensors=8)  # as gguf-split names them
    files = sorted(folder.glob("*.gguf"))
    assert first == files[0] and [p.name for p in files] == [f"model-{i:05d}-of-{len(files):05d}.gguf"
                                                             for i in range(1, len(files) + 1)]
    assert len(files) >= 3
    _, ids, whole = run(build(gguf_dir, "qwen3", "Q8_0"))  # the same model in one file
    for model in (first, files[-1], folder):  # any shard, or the folder, names the model
        assert run(model)[2] == whole
    moved = files[1].rename(tmp_path / files[1].name)
    for model in (first, folder):
        with pytest.raises(ModelLoadError, match=f"{files[1].name} is missing"):
            LLM(str(model), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02)
    moved.rename(files[1])
    # one shard fewer, renamed to look complete: the first shard's split metadata tells
    files[-1].unlink()
    for file in files[:-1]:
        file.rename(file.with_name(file.name.replace(f"of-{len(files):05d}", f"of-{len(files) - 1:05d}")))
    with pytest.raises(ModelLoadError, match="shards are not all of one model"):
        LLM(str(folder), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02)


def test_a_start_parses_the_gguf_once(gguf_dir, monkeypatch):
    # its metadata folder is built once; a start then reads the file once, for its tensors (a 49k-token vocabulary
    # took ~2 s a parse)
    path = build(gguf_dir, "qwen3", "Q8_0")
    run(path)
    opened, open_gguf = [], gguf_format.open_gguf
    monkeypatch.setattr(gguf_format, "open_gguf", lambda p: opened.append(p) or open_gguf(p))
    run(path)
    assert [p.name for p in opened] == [path.name]


BLOCK_CASES = [("llama", "Q4_0"), ("llama", "Q4_1"), ("phi3", "Q4_1")]  # Phi-3: fused tensors, blocks split too


@pytest.mark.parametrize("family, kind", BLOCK_CASES, ids=[f"{f}-{k}" for f, k in BLOCK_CASES])
def test_4bit_blocks_go_to_the_gemm_as_they_are(gguf_dir, family, kind, monkeypatch):
    if not cpu_linear.q4_panels_supported():
        pytest.skip("this CPU's build has no 4-bit panel GEMM (AVX-512)")
    detected = []
    monkeypatch.setattr(cpu_linear, "pack_compact", lambda w, g: detected.append(w.shape) or None)
    path = build(gguf_dir, family, kind)
    llm = LLM(str(path), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02)
    linears = [m for name, m in llm.engine.model_runner.model.named_modules() if name.endswith("proj")]
    assert linears and all(m.packed_weight.compact is not None for m in linears)
    assert detected == [] or all(shape[0] == llm.config.hf_config.vocab_size for shape in detected)  # LM head only
    # The blocks are the file's: d * q + m gives transformers' dequantized weight, every value (Q4_0's d may be
    # negative, so a zero can come out as -0.0 there and +0.0 here: equal values, no dot product changes).
    hf = hf_model(llm.config.model, torch.float32, config=transformers.AutoConfig.from_pretrained(llm.config.model))
    weight = hf.model.layers[0].mlp.down_proj.weight.detach()
    tensor = next(t for t in gguf_format.open_gguf(path).tensors if t.name == "blk.0.ffn_down.weight")
    d, m, q = (torch.from_numpy(np.array(b)) for b in gguf_format.q4_blocks(tensor))
    values = q.view(q.shape[0], -1, 32).float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)
    assert torch.equal(values.view_as(weight), weight)
    down = llm.engine.model_runner.model.model.layers[0].mlp.down_proj
    if kind == "Q4_1":  # and the very bytes the packer finds from the dequantized values (its d is >= 0)
        assert torch.equal(down.packed_weight.compact, cpu_ops().pack_q4_panels(weight.contiguous(), False))


def test_a_folder_holding_one_gguf_is_a_model_and_the_cli_runs_it(gguf_dir, tmp_path):
    path = build(gguf_dir, "qwen3", "Q8_0")
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello"}]}) + "\n")
    result = CliRunner().invoke(app, ["generate", str(source), "-o", str(out), "--model", str(path.parent),
                                      "--device", "cpu", "--max-model-len", "128", "--cpu-kvcache-space-gib",
                                      "0.02", "--max-tokens", "4", "--temperature", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["error"] is None and record["usage"]["completion_tokens"] >= 1


def test_the_tokenizer_and_chat_template_come_from_the_metadata(gguf_dir):
    path = build(gguf_dir, "qwen3", "F16")
    llm = LLM(str(path), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02)
    reference = transformers.AutoTokenizer.from_pretrained(path.with_suffix(".hf"))
    for text in ["The quick brown fox", "Paris is the capital of France; 1000 <|im_end|>", "def main(): {}"]:
        assert llm.encode(text) == reference.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert llm.apply_chat_template(chat) == reference.apply_chat_template(chat, tokenize=False,
                                                                         add_generation_prompt=True)
    assert llm.eos_token_ids == {reference.eos_token_id}


def rewrite_gguf(path, out, edit) -> Path:
    """A copy of the F32 GGUF `path` at `out` (same metadata) whose tensors are edit(tensors): tensors is a dict of
    name -> float32 values in torch's dim order; edit returns a dict of name -> values, or (raw bytes, raw type)."""
    import gguf

    reader = gguf.GGUFReader(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), gguf_format.field(reader, "general.architecture"))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1
                             else None)  # fmt: skip
    tensors = {t.name: np.array(t.data).reshape([int(x) for x in reversed(t.shape)]) for t in reader.tensors}
    for name, values in edit(tensors).items():
        if isinstance(values, tuple):
            raw, raw_type = values
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_type)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_an_unsupported_tensor_type_is_an_error_naming_it(gguf_dir, monkeypatch):
    import gguf

    def iq4_nl_down(tensors):  # IQ4_NL: 32 values in 18 bytes
        rows, columns = tensors["blk.0.ffn_down.weight"].shape
        raw = np.zeros((rows, columns // 32 * 18), dtype=np.uint8)
        return tensors | {"blk.0.ffn_down.weight": (raw, gguf.GGMLQuantizationType.IQ4_NL)}

    bad = rewrite_gguf(build(gguf_dir, "qwen2", "F32"), gguf_dir / "iq" / "model.gguf", iq4_nl_down)
    with pytest.raises(ModelLoadError, match="blk.0.ffn_down.weight is of type IQ4_NL"):
        LLM(str(bad), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02)


def write_stub(path, arch: str, block_count: int = 1, **metadata) -> None:
    """A GGUF of `arch` with an embedding and the given metadata only: enough to be refused."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(block_count)
    writer.add_embedding_length(4)
    writer.add_head_count(1)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unsupported_architecture_is_an_error_naming_it(tmp_path):
    write_stub(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(NanoInferError, match="GGUF architecture 'mamba' is not supported"):
        LLM(str(tmp_path / "mamba.gguf"), device="cpu")


def test_an_olmo3_gguf_is_refused_not_run_as_olmo2(tmp_path):
    # llama.cpp writes OLMo 3 under the olmo2 architecture, with a sliding window OLMo 2 does not have
    write_stub(tmp_path / "olmo3.gguf", "olmo2", sliding_window=4096)
    with pytest.raises(ModelLoadError, match="is an OLMo 3 GGUF"):
        LLM(str(tmp_path / "olmo3.gguf"), device="cpu")


# ---- mixture of experts: qwen3moe, and Mixtral as llama.cpp writes it (a llama with experts) --------------------
MOE_CASES = [(family, kind) for family in ("qwen3_moe", "mixtral") for kind in ("F32", "Q8_0", "Q4_0")]
MOE_CASES += [("qwen3_moe", "Q4_K")]


@pytest.mark.parametrize("family, kind", MOE_CASES, ids=[f"{f}-{k}" for f, k in MOE_CASES])
def test_moe_gguf_greedy_tokens_equal_the_weights_it_holds(gguf_dir, family, kind):
    # float32: the HF folder the file came from; quantized: that folder's weights as the file stores them (the
    # same quantization, dequantized by the gguf package), and transformers on the file itself where its GGUF
    # loader reads the architecture (qwen3moe; it has no llama with experts)
    path, llm, ids, ours = run_family(gguf_dir, family, kind)
    if kind != "F32" and not kind.endswith("_K"):  # K-quant files hold random blocks: only transformers knows them
        assert ours == hf_greedy(stored_weights_folder(path, kind), ids, NUM_TOKENS)[0]
    if family == "qwen3_moe":
        assert_transformers_on_the_file_agrees(path, llm, ids, ours)


def test_a_qwen3moe_gguf_routes_as_llama_cpp_runs_it(gguf_dir):
    # llama.cpp's qwen3moe always renormalizes the top k and has experts in every layer; the converter writes
    # Qwen3's dense intermediate_size as feed_forward_length and the experts' as expert_feed_forward_length
    llm, _, _ = run(build(gguf_dir, "qwen3_moe", "F32"))
    config = llm.config.hf_config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.norm_topk_prob is True and config.decoder_sparse_step == 1 and config.mlp_only_layers == []
    with pytest.raises(ValueError, match="renormalized"):  # and so the writer refuses what llama.cpp cannot run
        build_tiny_gguf("qwen3_moe", gguf_dir / "mixed" / "model.gguf", mlp_only_layers=[0])


def test_a_llama_gguf_without_experts_stays_llama_and_one_with_experts_runs_as_mixtral(gguf_dir):
    assert gguf_format.GGUFModel(build(gguf_dir, "llama", "F32")).family.__name__ == "LlamaForCausalLM"
    assert gguf_format.GGUFModel(build(gguf_dir, "mixtral", "F32")).family.__name__ == "MixtralForCausalLM"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fused_gate_up_experts_load_as_gate_and_up(gguf_dir, family):
    # llama.cpp's --fuse-gate-up-exps: one [experts, 2 x width, hidden] tensor, each expert's gate rows then its up
    # (and gpt-oss's biases likewise, [experts, 2 x width])
    path = build(gguf_dir, family, "F32")

    def fuse(tensors):
        fused = {}
        for name, values in tensors.items():
            if "ffn_gate_exps" in name:
                up = tensors[name.replace("ffn_gate_exps", "ffn_up_exps")]
                fused[name.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate([values, up], axis=1)
            elif "ffn_up_exps" not in name:
                fused[name] = values
        return fused

    fused = rewrite_gguf(path, gguf_dir / f"fused-{family}" / "model.gguf", fuse)
    assert run(fused)[2] == run(path)[2]


def without_tensor(name: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


def first_experts_only(name: str, num_experts: int):
    return lambda tensors: tensors | {name: tensors[name][:num_experts]}


@pytest.mark.parametrize("family, edit, message", [
    ("qwen3_moe", without_tensor("blk.1.ffn_up_exps.weight"), "tensor blk.1.ffn_up_exps.weight is missing"),
    ("mixtral", without_tensor("blk.0.ffn_down_exps.weight"), "tensor blk.0.ffn_down_exps.weight is missing"),
    ("qwen3_moe", first_experts_only("blk.0.ffn_down_exps.weight", 4),
     r"tensor blk.0.ffn_down_exps.weight has shape \(4, 64, 32\) \[experts, rows, columns\], but the model its "
     r"metadata describes takes \(8, 64, 32\)"),
], ids=["missing-qwen3moe", "missing-mixtral", "mis-shaped"])  # fmt: skip
def test_a_missing_or_mis_shaped_expert_tensor_is_an_error_naming_it(gguf_dir, tmp_path, family, edit, message):
    bad = rewrite_gguf(build(gguf_dir, family, "F32"), tmp_path / "bad" / "model.gguf", edit)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(bad), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02)


def test_a_gguf_with_experts_but_no_expert_used_count_is_refused(tmp_path):
    write_stub(tmp_path / "moe.gguf", "llama", expert_count=8)
    with pytest.raises(ModelLoadError, match="needs llama.expert_count and llama.expert_used_count"):
        LLM(str(tmp_path / "moe.gguf"), device="cpu")


# ---- gpt-oss: attention sinks, q/k/v/o and expert biases, YaRN, alternating windows, experts in MXFP4 -------------
@pytest.mark.parametrize("kind", ["F32", "MXFP4"])
def test_gpt_oss_gguf_greedy_tokens_equal_the_weights_it_holds(gguf_dir, kind):
    # float32: the HF folder the file came from; MXFP4 (the experts only, as llama.cpp's converter writes a published
    # checkpoint): that folder with the experts' weights rounded to what the file's blocks hold, which transformers
    # runs as float32. The prompts reach past the sliding layers' window.
    path = build(gguf_dir, "gpt_oss", kind)
    expert_types = {t.tensor_type.name for t in gguf_format.GGUFModel(path).tensors if "_exps.weight" in t.name}
    assert expert_types == {kind}
    llm, ids, ours = run(path)
    assert llm.config.hf_config.architectures == ["GptOssForCausalLM"]
    folder = path.with_suffix(".hf") if kind == "F32" else stored_weights_folder(path, kind)
    assert ours == hf_greedy(folder, ids, NUM_TOKENS)[0]


def test_a_gpt_oss_gguf_gets_its_config_as_llama_cpp_runs_it(gguf_dir, tmp_path):
    # the source folder's YaRN (truncate false, as every gpt-oss config), windows on even layers (llama.cpp's pattern
    # 2), the SwiGLU constants llama.cpp hard-codes (gpt-oss's published alpha 1.702 and limit 7)
    path = build(gguf_dir, "gpt_oss", "F32")
    config = json.loads((Path(run(path)[0].config.model) / "config.json").read_text())
    source = json.loads((path.with_suffix(".hf") / "config.json").read_text())
    assert config["rope_scaling"] == {k: v for k, v in source["rope_parameters"].items() if k != "rope_theta"}
    assert config["rope_theta"] == source["rope_parameters"]["rope_theta"]
    for key in ("layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit", "attention_bias", "head_dim",
                "intermediate_size", "num_local_experts", "num_experts_per_tok", "max_position_embeddings"):
        assert config[key] == source[key], key
    assert (config["swiglu_limit"], config["layer_types"]) == (7.0, ["sliding_attention", "full_attention"])
    # a file with llama.cpp's optional attention.sliding_window_pattern: layer i slides when i % n < n - 1
    write_stub(tmp_path / "pattern.gguf", "gpt-oss", block_count=4, expert_count=8, expert_used_count=2,
               sliding_window=24, sliding_window_pattern=3)  # fmt: skip
    layer_types = gguf_format.hf_config(gguf_format.GGUFModel(tmp_path / "pattern.gguf"))["layer_types"]
    assert layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="even layers"):  # and the writer refuses a model llama.cpp cannot run
        build_tiny_gguf("gpt_oss", tmp_path / "odd" / "model.gguf", layer_types=["full_attention"] * 2)


def converter_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GptOssModel.repack_mxfp4 in llama.cpp's converter: HF's blocks [..., G, 16] (code 2j in byte j's low nibble,
    2j + 1 in its high one) and scales [..., G] -> GGML's MXFP4 blocks [..., G * 17]: the scale byte, then code j in
    byte j's low nibble and code j + 16 in its high one."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(*scales.shape[:-1], -1).astype(np.uint8)


def test_gguf_mxfp4_reads_a_published_checkpoints_blocks_as_its_hf_loader_does():
    # the same bytes through both readings: HF's *_blocks / *_scales (models/gpt_oss.dequantize_mxfp4) and, repacked
    # as llama.cpp's converter repacks them, the GGUF's MXFP4 tensor (the gguf package's dequantizer)
    import gguf

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(118, 136, size=(3, 8, 2), dtype=np.uint8)
    ggml = gguf.quants.dequantize(converter_mxfp4(blocks, scales), gguf.GGMLQuantizationType.MXFP4)
    hf = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert ggml.shape == (3, 8, 64)
    np.testing.assert_array_equal(ggml, hf.numpy())


@pytest.mark.parametrize("edit, message", [
    (without_tensor("blk.1.attn_sinks.weight"), "tensor blk.1.attn_sinks.weight is missing"),
    (without_tensor("blk.0.ffn_gate_exps.bias"), "tensor blk.0.ffn_gate_exps.bias is missing"),
    (without_tensor("blk.1.ffn_down_exps.bias"), "tensor blk.1.ffn_down_exps.bias is missing"),
    (first_experts_only("blk.0.ffn_up_exps.bias", 4),
     r"tensor blk.0.ffn_up_exps.bias has shape \(4, 32\) \[experts, rows\], but the model its metadata describes "
     r"takes \(8, 32\)"),
], ids=["sinks", "gate-bias", "down-bias", "mis-shaped-bias"])  # fmt: skip
def test_a_missing_gpt_oss_sinks_or_expert_bias_tensor_is_an_error_naming_it(gguf_dir, tmp_path, edit, message):
    bad = rewrite_gguf(build(gguf_dir, "gpt_oss", "F32"), tmp_path / "bad" / "model.gguf", edit)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(bad), device="cpu", max_model_len=128, cpu_kvcache_space_gib=0.02)
