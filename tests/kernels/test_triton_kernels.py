"""The Triton kernels against attention/reference.py: KV-cache store, paged decode, paged prefill, and the
TritonBackend that dispatches between them. On CPU they run in Triton's interpreter (see conftest.py).

Shapes stay small (few heads, few sequences) because the interpreter runs each program in Python, but every
case crosses a block boundary and reads blocks handed out in shuffled order.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")

from nanoinfer.attention.reference import paged_attention_reference, store_kvcache_reference
from nanoinfer.platforms.cuda import triton_backend
from nanoinfer.platforms.cuda.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache
from nanoinfer.platforms.cuda.triton_backend import TritonBackend

# float32 must match the oracle to rounding; bfloat16 rounds the softmax weights before P @ V, as
# flash-attention does, so it gets a few bfloat16 ulps (one ulp at 1.0 is 0.0078).
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def assert_matches_reference(out, batch, rows=slice(None)):
    scale = batch.query.shape[-1] ** -0.5
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), **TOLERANCES[batch.query.dtype])


# --- KV-cache store ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_each_token_to_its_slot_and_skips_padding(paged_batch, dtype):
    batch = paged_batch([(0, 20), (250, 12), (3, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=256,
                        dtype=dtype)
    slot_mapping = batch.metadata.slot_mapping.clone()
    slot_mapping[[0, 7, 20]] = -1  # padding tokens, e.g. a CUDA-graph batch filled up to its bucket size
    # key/value as strided views of one fused tensor, as the model's QKV projection produces them.
    fused = torch.cat([batch.key, batch.value], dim=1)  # [num_tokens, 2 * H_kv, D]
    key, value = fused[:, :2], fused[:, 2:]
    assert not key.is_contiguous()
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    store_kvcache_reference(key, value, expected_k, expected_v, slot_mapping)

    store_kvcache(key, value, batch.k_cache, batch.v_cache, slot_mapping)

    assert torch.equal(batch.k_cache, expected_k)
    assert torch.equal(batch.v_cache, expected_v)


def test_store_rounds_keys_into_a_narrower_cache(paged_batch):
    """kv_cache_dtype bfloat16 under a float32 model. Compiled, Triton rounds to nearest even, exactly as
    torch's .to() does; its CPU interpreter truncates instead (numpy), so there the oracle truncates too."""
    batch = paged_batch([(0, 20), (250, 12)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=256,
                        cache_dtype=torch.bfloat16)  # fmt: skip
    assert batch.key.dtype == torch.float32 and batch.k_cache.dtype == torch.bfloat16
    compiled = batch.key.device.type == "cuda"

    def to_bf16(x: torch.Tensor) -> torch.Tensor:
        if compiled:
            return x.to(torch.bfloat16)
        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)  # exact: low bits zero

    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    store_kvcache_reference(to_bf16(batch.key), to_bf16(batch.value), expected_k, expected_v,
                            batch.metadata.slot_mapping)  # fmt: skip

    store_kvcache(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)

    assert torch.equal(batch.k_cache, expected_k) and torch.equal(batch.v_cache, expected_v)


def test_store_rejects_keys_and_values_of_different_dtypes(paged_batch):
    batch = paged_batch([(0, 4)], num_heads=2, num_kv_heads=2, head_dim=64, block_size=256)
    with pytest.raises(ValueError, match="key/value dtypes torch.bfloat16/torch.float32"):
        store_kvcache(batch.key.bfloat16(), batch.value, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)


# --- paged decode -----------------------------------------------------------------------------------

# (num_heads, num_kv_heads, head_dim, block_size, seq_lens): GQA ratios 1, 2, 4; lengths on, just past and
# well past block boundaries; a 1-token context.
DECODE_CASES = [
    pytest.param(2, 2, 64, 256, [1, 256, 257, 700], id="gqa1-d64-bs256"),
    pytest.param(4, 2, 128, 512, [511, 512, 1100], id="gqa2-d128-bs512"),
    pytest.param(8, 2, 64, 512, [40, 513], id="gqa4-d64-bs512"),
    pytest.param(4, 1, 128, 256, [300, 5], id="gqa4-d128-bs256"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "seq_lens"), DECODE_CASES)
@pytest.mark.parametrize("num_splits", [pytest.param(1, id="one-split"), pytest.param(3, id="three-splits")])
def test_decode_matches_reference(paged_batch, dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens,
                                  num_splits):
    batch = paged_batch([(seq_len - 1, 1) for seq_len in seq_lens], num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    md = batch.metadata
    out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, head_dim**-0.5, num_splits=num_splits)
    assert_matches_reference(out, batch)


def test_decode_splits_a_long_context_by_default_and_merges_exactly(paged_batch):
    # One sequence, one KV head: the default picks several splits to fill the device; short sequences in the
    # same batch leave most of their splits empty.
    batch = paged_batch([(1499, 1), (9, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=256)
    md = batch.metadata
    out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, 0.125)
    assert_matches_reference(out, batch)


def test_decode_as_captured_in_a_cuda_graph_matches_reference(paged_batch):
    # A decode graph is captured once with max_seq_len = max_model_len and block tables as wide as
    # max_model_len needs; each replay has shorter contexts, zero-padded tables and padded rows (seq_len 1).
    batch = paged_batch([(299, 1), (8, 1), (0, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=256)
    md = batch.metadata
    max_model_len = 4096
    tables = torch.zeros(md.block_tables.shape[0], max_model_len // 256, dtype=md.block_tables.dtype,
                         device=md.block_tables.device)  # fmt: skip
    tables[:, : md.block_tables.shape[1]] = md.block_tables
    out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, tables, md.seq_lens, max_model_len, 0.125)
    assert torch.isfinite(out).all()
    assert_matches_reference(out, batch)


def test_decode_writes_zeros_for_a_padded_sequence_with_empty_context(paged_batch):
    # CUDA-graph batches are padded with seq_len 0 entries; they must not produce NaN.
    batch = paged_batch([(299, 1), (0, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=256)
    md = batch.metadata
    md.seq_lens[1] = 0
    for num_splits in (1, 2):
        out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                     md.max_seq_len, 0.125, num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        md.seq_lens[1] = 1
        assert_matches_reference(out, batch, rows=slice(0, 1))
        md.seq_lens[1] = 0


# --- paged prefill over a cached prefix -------------------------------------------------------------

# (num_heads, num_kv_heads, head_dim, block_size, specs), specs = (cached tokens, query tokens) per sequence:
# fresh prompts, chunks of a prompt whose prefix is cached (crossing block boundaries), decode tokens and
# 1-token prompts, all in one batch.
PREFILL_CASES = [
    pytest.param(2, 2, 64, 256, [(0, 37), (250, 20), (300, 1), (0, 1)], id="gqa1-d64-bs256"),
    pytest.param(4, 2, 128, 512, [(400, 130), (512, 3), (0, 20)], id="gqa2-d128-bs512"),
    pytest.param(8, 2, 64, 256, [(10, 70), (0, 5), (511, 2)], id="gqa4-d64-bs256"),
    pytest.param(4, 1, 128, 512, [(200, 100), (1, 1)], id="gqa4-d128-bs512"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "specs"), PREFILL_CASES)
def test_prefill_matches_reference(paged_batch, dtype, num_heads, num_kv_heads, head_dim, block_size, specs):
    batch = paged_batch(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=block_size, dtype=dtype)
    md = batch.metadata
    out = paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                  md.query_start_loc, md.max_query_len, head_dim**-0.5)
    assert_matches_reference(out, batch)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_float32_queries_over_a_bfloat16_cache_match_the_reference(paged_batch, kernel):
    """kv_cache_dtype bfloat16 under a float32 model: keys and values are widened exactly and everything else
    stays float32, so the result matches the float32 oracle on the same (bfloat16) cache to float32 rounding."""
    specs = [(0, 1), (256, 1), (700, 1)] if kernel == "decode" else [(10, 70), (0, 5), (511, 2)]
    batch = paged_batch(specs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=256, cache_dtype=torch.bfloat16)
    md = batch.metadata
    if kernel == "decode":
        out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                     md.max_seq_len, 0.125, num_splits=3)  # fmt: skip
    else:
        out = paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                      md.query_start_loc, md.max_query_len, 0.125)  # fmt: skip
    assert batch.k_cache.dtype == torch.bfloat16
    assert_matches_reference(out, batch)


def test_prefill_with_small_query_tiles_covers_every_token(paged_batch):
    # block_m 16 with 4 query heads per KV head: 4 tokens per tile, so a sequence spans many tiles whose
    # causal limits all differ; a strided query (a view of a fused QKV output) too.
    batch = paged_batch([(5, 30), (256, 9)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=256)
    md = batch.metadata
    fused = torch.cat([batch.query, batch.query[:, :1]], dim=1)
    query = fused[:, :8]
    assert not query.is_contiguous()
    out = paged_prefill_attention(query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                  md.query_start_loc, md.max_query_len, 0.125, block_m=16)
    assert_matches_reference(out, batch)


@pytest.mark.parametrize(
    ("head_dim", "change", "message"),
    [
        (64, lambda b: setattr(b.metadata, "block_tables", b.metadata.block_tables.long()),
         "block_tables must be int32"),
        (48, lambda b: None, "head_dim 48 must be a power of two"),
        (64, lambda b: setattr(b, "k_cache", b.k_cache.half()), "dtypes torch.float32/torch.float16/torch.float32"),
    ],
    ids=["int64-block-tables", "head-dim-48", "mixed-dtypes"],
)
def test_attention_launchers_reject_bad_inputs_before_launch(paged_batch, head_dim, change, message):
    batch = paged_batch([(3, 2)], num_heads=2, num_kv_heads=2, head_dim=head_dim, block_size=256)
    change(batch)
    md = batch.metadata
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                md.query_start_loc, md.max_query_len, 0.125)


# --- TritonBackend ----------------------------------------------------------------------------------


def spy_on(monkeypatch, name):
    calls = []
    original = getattr(triton_backend, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_backend, name, spy)
    return calls


@pytest.mark.parametrize(
    ("specs", "kernel"),
    [
        pytest.param([(299, 1), (4, 1), (511, 1)], "paged_decode_attention", id="pure-decode"),
        pytest.param([(299, 1), (0, 12), (250, 9)], "paged_prefill_attention", id="mixed"),
    ],
)
def test_backend_stores_then_attends_like_the_reference(paged_batch, monkeypatch, specs, kernel):
    batch = paged_batch(specs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=256)
    decode_calls = spy_on(monkeypatch, "paged_decode_attention")
    prefill_calls = spy_on(monkeypatch, "paged_prefill_attention")
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    store_kvcache_reference(batch.key, batch.value, expected_k, expected_v, batch.metadata.slot_mapping)
    backend = TritonBackend()

    backend.store_kvcache(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125,
                          new_kv=(batch.key, batch.value))

    assert torch.equal(batch.k_cache, expected_k)
    assert decode_calls + prefill_calls == [kernel]
    expected = paged_attention_reference(batch.query, expected_k, expected_v, batch.metadata, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


# --- sliding window, soft cap and sinks (Mistral, Gemma 2 and 3, OLMo 3, gpt-oss) ----------------------

SINKS = [-2.0, 0.5, 2.0, 5.0]  # one a query head (4); up to most of the softmax's weight
MASKS = [
    pytest.param(dict(sliding_window=24), id="window24"),
    pytest.param(dict(soft_cap=5.0), id="softcap5"),
    pytest.param(dict(sliding_window=100, soft_cap=20.0), id="window100-softcap20"),
    pytest.param(dict(sinks=SINKS), id="sinks"),
    pytest.param(dict(sliding_window=24, sinks=SINKS), id="window24-sinks"),
    pytest.param(dict(soft_cap=5.0, sinks=SINKS), id="softcap5-sinks"),
]


def on_device(mask: dict, device) -> dict:
    """The mask's keywords with its sinks as the kernels take them: float32 [H_q] on the batch's device."""
    if "sinks" not in mask:
        return mask
    return dict(mask, sinks=torch.tensor(mask["sinks"], dtype=torch.float32, device=device))


def assert_matches_masked_reference(out, batch, mask):
    scale = batch.query.shape[-1] ** -0.5
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, **mask)
    # The kernels' tanh is 2 sigmoid(2x) - 1: float32 rounding of the capped scores, a few ulps of the scores.
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[batch.query.dtype])


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("num_splits", [pytest.param(1, id="one-split"), pytest.param(3, id="three-splits")])
def test_decode_with_window_and_soft_cap_matches_reference(paged_batch, mask, num_splits):
    batch = paged_batch([(0, 1), (23, 1), (24, 1), (299, 1), (700, 1)], num_heads=4, num_kv_heads=2, head_dim=64,
                        block_size=256)  # fmt: skip
    md = batch.metadata
    mask = on_device(mask, batch.query.device)
    out = paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, 64**-0.5, num_splits=num_splits, **mask)  # fmt: skip
    assert_matches_masked_reference(out, batch, mask)


@pytest.mark.parametrize("mask", MASKS)
def test_prefill_with_window_and_soft_cap_matches_reference(paged_batch, mask):
    # Chunks with and without a cached prefix, longer and shorter than the window, crossing a block boundary.
    batch = paged_batch([(0, 130), (250, 20), (40, 3), (0, 5)], num_heads=4, num_kv_heads=2, head_dim=64,
                        block_size=256)  # fmt: skip
    md = batch.metadata
    mask = on_device(mask, batch.query.device)
    out = paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                                  md.query_start_loc, md.max_query_len, 64**-0.5, **mask)  # fmt: skip
    assert_matches_masked_reference(out, batch, mask)
