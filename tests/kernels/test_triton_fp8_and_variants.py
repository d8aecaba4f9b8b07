"""fp8 KV caches through the Triton kernels (kv_cache_dtype fp8_e4m3 / fp8_e5m2 on CUDA), and the decode
variants scripts/gpu_check.sh measures, against attention/reference.py. Run in Triton's interpreter on CPU
(conftest.py); with TRITON_INTERPRET=0 on a GPU, the same tests check the compiled kernels.

The store must give torch's bits (attention/torch_backend.py to_cache_dtype: round to nearest even, saturate
at the largest finite value); the attention kernels must read an fp8 cache exactly (the oracle widens the same
cache); and what fp8 costs in accuracy is checked twice: attention within e4m3's rounding of the exact result,
and a whole model's greedy tokens by vLLM's logprobs rule against a bfloat16 cache.
"""

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")

from nanoinfer.attention.reference import paged_attention_reference, store_kvcache_reference
from nanoinfer.attention.torch_backend import to_cache_dtype
from nanoinfer.platforms.cuda.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache
from nanoinfer.platforms.cuda.triton_backend import TritonBackend

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
# The query's dtype sets the tolerance against the oracle on the same cache (as in test_triton_kernels.py).
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
E4M3_UNIT_ROUNDOFF = 2.0**-4  # 3 mantissa bits: a value is off by at most half a step, 2^-4 of itself


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# --- store -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("key_dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_store_into_an_fp8_cache_gives_torchs_bits_saturating_at_the_largest_finite_value(
    paged_batch, cache_dtype, key_dtype
):
    """Every binade from e4m3's smallest subnormal up, values past the largest finite one (which must saturate,
    not become NaN or inf) and halfway cases (ties to even), from float32 and from bfloat16 keys."""
    batch = paged_batch([(0, 40), (250, 24)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=256,
                        dtype=key_dtype, cache_dtype=cache_dtype)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    spread = torch.logspace(-3.5, 2.5, 64)  # 3e-4 .. 316 across the head dim
    key = (torch.randn(batch.key.shape, generator=gen) * spread).to(key_dtype)
    value = (torch.randn(batch.value.shape, generator=gen) * spread.flip(0)).to(key_dtype)
    largest = torch.finfo(cache_dtype).max
    key[0, 0, :6] = torch.tensor([2 * largest, -2 * largest, largest, 17.0, 19.0, 2.0**-10], dtype=key_dtype)
    key = key.to(batch.key.device)
    value = value.to(batch.key.device)
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    store_kvcache_reference(to_cache_dtype(key.float(), cache_dtype), to_cache_dtype(value.float(), cache_dtype),
                            expected_k, expected_v, batch.metadata.slot_mapping)  # fmt: skip

    store_kvcache(key, value, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)

    assert torch.equal(bits(batch.k_cache), bits(expected_k))
    assert torch.equal(bits(batch.v_cache), bits(expected_v))
    slot = int(batch.metadata.slot_mapping[0])
    stored = batch.k_cache.view(-1, 2, 64)[slot, 0, :3].float().tolist()
    assert stored == [largest, -largest, largest]  # saturated


# --- attention over an fp8 cache -------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("kernel", ["decode", "decode-3-splits", "prefill"])
def test_attention_reads_an_fp8_cache_as_the_reference_does(paged_batch, cache_dtype, dtype, kernel):
    """fp8 values are bfloat16 (and float32) values, so widening them as they load is exact: the result matches
    the oracle on the same fp8 cache as closely as on a cache of the query's dtype."""
    specs = [(0, 1), (256, 1), (700, 1)] if kernel.startswith("decode") else [(10, 70), (0, 5), (511, 2)]
    batch = paged_batch(specs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=256, dtype=dtype,
                        cache_dtype=cache_dtype)  # fmt: skip
    md = batch.metadata
    if kernel.startswith("decode"):
        out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                     md.max_seq_len, 0.125, num_splits=3 if kernel.endswith("splits") else 1)
    else:
        out = paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                      md.query_start_loc, md.max_query_len, 0.125)  # fmt: skip
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, md, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("seed", [0, 1])
def test_e4m3_cache_attention_is_within_e4m3_rounding_of_the_exact_result(paged_batch, seed):
    """The same float32 keys and values stored into a bfloat16 and an e4m3 cache, then decoded with float32
    queries. Rounding to nearest leaves each value off by a uniform share of half a step: RMS u / sqrt(3) of
    itself with u = 2^-4. The output carries one such error through V and about one through K's effect on the
    softmax, RMS sqrt(2) u / sqrt(3) (~5.1%) of its size for these N(0, 1) data; we allow twice that. A misread
    fp8 byte would be off by its whole size."""
    batch = paged_batch([(299, 1), (40, 1), (520, 1)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=256,
                        seed=seed)  # fmt: skip
    md = batch.metadata
    slots = torch.tensor([table[pos // 256] * 256 + pos % 256 for table, seq_len in
                          zip(md.block_tables.tolist(), md.seq_lens.tolist()) for pos in range(seq_len)],
                         device=batch.k_cache.device)  # every slot the sequences read  # fmt: skip
    keys = batch.k_cache.view(-1, 2, 64)[slots]
    values = batch.v_cache.view(-1, 2, 64)[slots]
    exact = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, md, 0.125)

    def relative_rms_error(cache_dtype) -> float:
        k_cache = torch.empty(batch.k_cache.shape, dtype=cache_dtype, device=batch.k_cache.device)
        v_cache = torch.empty_like(k_cache)
        store_kvcache(keys, values, k_cache, v_cache, slots)
        out = paged_decode_attention(batch.query, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len,
                                     0.125)  # fmt: skip
        return float((out - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())

    fp8_error, bf16_error = relative_rms_error(torch.float8_e4m3fn), relative_rms_error(torch.bfloat16)
    bound = 2 * math.sqrt(2) * E4M3_UNIT_ROUNDOFF / math.sqrt(3)
    assert fp8_error <= bound, f"e4m3 cache: relative RMS error {fp8_error:.3f} > {bound:.3f}"
    assert bf16_error < fp8_error / 4  # bfloat16 keeps 4 more bits: ~1/16 the error


# --- decode variants ---------------------------------------------------------------------------------------

# Each variant gives the same result: tiles of 16..256 keys, each sequence's own context split evenly, Triton's
# launch options (ignored by the interpreter, checked for compiling by test_gpu_compile.py).
VARIANTS = [
    pytest.param({"tile_n": 16}, id="tile16"),
    pytest.param({"tile_n": 128, "num_warps": 8}, id="tile128-warps8"),
    pytest.param({"tile_n": 256, "num_stages": 2}, id="tile256-stages2"),
    pytest.param({"split_by_seq_len": True, "num_splits": 3}, id="by-seq-len-3"),
    pytest.param({"split_by_seq_len": True, "num_splits": 8, "tile_n": 32}, id="by-seq-len-8-tile32"),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cache_dtype", [pytest.param(None, id="fp32"), pytest.param(torch.float8_e4m3fn, id="e4m3")])
def test_decode_variants_match_the_reference(paged_batch, variant, cache_dtype):
    # A padded slot (seq_len 0), a 1-token context, and contexts on, past and well past block boundaries; block
    # tables as wide as a CUDA graph's (max_seq_len = 2048), so fixed partitions leave most splits empty.
    batch = paged_batch([(0, 1), (255, 1), (256, 1), (1100, 1), (0, 1)], num_heads=4, num_kv_heads=2, head_dim=64,
                        block_size=256, cache_dtype=cache_dtype)  # fmt: skip
    md = batch.metadata
    md.seq_lens[4] = 0
    tables = torch.zeros(md.block_tables.shape[0], 8, dtype=md.block_tables.dtype, device=md.block_tables.device)
    tables[:, : md.block_tables.shape[1]] = md.block_tables
    out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, tables, md.seq_lens, 2048, 0.125,
                                 **variant)  # fmt: skip
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # an empty context gives zeros, not NaN
    md.seq_lens[4] = 1
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, md, 0.125)
    torch.testing.assert_close(out[:4], expected[:4], **TOLERANCES[torch.float32])


def test_decode_rejects_a_tile_that_does_not_divide_the_block(paged_batch):
    batch = paged_batch([(3, 1)], num_heads=2, num_kv_heads=2, head_dim=64, block_size=256)
    md = batch.metadata
    with pytest.raises(ValueError, match="tile_n 512 must be a power of two >= 16 dividing the block size 256"):
        paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                               md.max_seq_len, 0.125, tile_n=512)  # fmt: skip


# --- the backend and a whole model -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "specs", [pytest.param([(299, 1), (4, 1)], id="pure-decode"), pytest.param([(299, 1), (0, 12)], id="mixed")]
)
def test_backend_stores_into_an_fp8_cache_then_attends_like_the_reference(paged_batch, specs):
    batch = paged_batch(specs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=256, dtype=torch.bfloat16,
                        cache_dtype=torch.float8_e4m3fn)  # fmt: skip
    md = batch.metadata
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    store_kvcache_reference(to_cache_dtype(batch.key.float(), torch.float8_e4m3fn),
                            to_cache_dtype(batch.value.float(), torch.float8_e4m3fn), expected_k, expected_v,
                            md.slot_mapping)  # fmt: skip
    backend = TritonBackend()
    backend.store_kvcache(batch.key, batch.value, batch.k_cache, batch.v_cache, md.slot_mapping)
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, md, 0.125, new_kv=(batch.key, batch.value))
    assert torch.equal(bits(batch.k_cache), bits(expected_k)) and torch.equal(bits(batch.v_cache), bits(expected_v))
    expected = paged_attention_reference(batch.query, expected_k, expected_v, md, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[torch.bfloat16])


def test_fp8_cache_through_the_triton_kernels_is_close_to_a_bfloat16_cache_by_logprobs(tmp_path, monkeypatch,
                                                                                       device):  # fmt: skip
    """A bfloat16 model (CUDA's default) with its cache in e4m3 against the same model with a bfloat16 cache,
    both through the Triton kernels (interpreted here, with chunked prefill so later chunks read the rounded
    cache), by vLLM's check_logprobs_close rule: where the two first differ, each token is in the other's top 5.
    e4m3's 3 mantissa bits move these tiny random models' near-flat logits, so some sequences may differ (the
    CPU test of the same cache, tests/model/test_hf_equivalence.py, allows half); the cache is half the bytes."""
    if device != "cpu":
        pytest.skip("the engine on CPU with the Triton backend is the interpreter's check; on CUDA tests/gpu run it")
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.platforms.cpu import CpuKernelPlatform, CpuPlatform
    from nanoinfer.testing.hf_reference import check_logprobs_close
    from nanoinfer.testing.tiny_models import build_tiny_model

    for platform in (CpuPlatform, CpuKernelPlatform):  # CPU tensors, Triton kernels
        monkeypatch.setattr(platform, "attention_backend", lambda self, name: TritonBackend())
    path = build_tiny_model("qwen3", tmp_path / "qwen3")
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(12 + 5 * i)] for i in range(8)]  # 12..47 tokens
    settings = dict(dtype="bfloat16", device="cpu", max_model_len=256, cpu_kvcache_space_gib=0.05,
                    max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    runs = {}
    for kv_cache_dtype in ("bfloat16", "fp8_e4m3"):
        llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, **settings)
        assert isinstance(llm.engine.model_runner.backend, TritonBackend)
        outputs = llm.generate(prompts, params)
        runs[kv_cache_dtype] = [(o.token_ids, [{t for t, _ in lp.top} for lp in o.outputs[0].logprobs])
                                for o in outputs]  # fmt: skip
        runs[kv_cache_dtype, "block_bytes"] = llm.engine.plan.block_bytes
    diverged = check_logprobs_close(runs["fp8_e4m3"], runs["bfloat16"], ("e4m3 cache", "bfloat16 cache"))
    print(f"e4m3 against bfloat16 cache, Triton kernels: {diverged}/{len(prompts)} sequences diverged")
    assert diverged <= len(prompts) // 2, f"{diverged}/{len(prompts)} sequences diverged"
    assert runs["fp8_e4m3", "block_bytes"] * 2 == runs["bfloat16", "block_bytes"]
