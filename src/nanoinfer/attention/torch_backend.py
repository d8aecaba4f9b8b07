"""The plain-torch backend (any device): batched decode over the paged cache, SDPA for prefill.

Decode sequences (query_len 1) go to one batched matmul over their gathered slots; prefill chunks go one
sequence at a time through SDPA (reading this step's keys directly when the sequence has no cached prefix).
platforms/cpu/attention.py runs the same plan on the C++ kernels. Checked against reference.py in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from nanoinfer.attention.metadata import AttentionMetadata


@dataclass
class _StepPlan:
    """What forward() derives from a step's metadata: built once per step, shared by every layer."""

    query_lens: list[int]
    seq_lens: list[int]
    starts: list[int]  # token offset of each sequence's queries (len num_seqs + 1)
    decode_ids: list[int]  # sequences with one query token
    decode_rows: torch.Tensor | None  # their rows in the token dimension; None when every sequence decodes
    decode_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_lens: torch.Tensor  # [num_decode] int32
    prefill_ids: list[int]  # sequences with more than one query token (prompt chunks)
    _prefill_args: tuple[torch.Tensor, ...] | None = None  # the C++ prefill kernel's, built on first use

    def prefill_args(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        """(block tables, query starts, query lengths, sequence lengths) of the prompt chunks, int32."""
        if self._prefill_args is None:
            ids = self.prefill_ids
            index = torch.tensor(ids, dtype=torch.long, device=metadata.block_tables.device)
            self._prefill_args = (
                metadata.block_tables[index].int(),
                torch.tensor([self.starts[i] for i in ids], dtype=torch.int32),
                torch.tensor([self.query_lens[i] for i in ids], dtype=torch.int32),
                torch.tensor([self.seq_lens[i] for i in ids], dtype=torch.int32),
            )
        return self._prefill_args

    @classmethod
    def build(cls, metadata: AttentionMetadata, device: torch.device) -> _StepPlan:
        query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
        if query_lens is None or seq_lens is None:
            starts = metadata.query_start_loc.tolist()
            query_lens = [b - a for a, b in zip(starts, starts[1:])]
            seq_lens = metadata.seq_lens.tolist()
        else:
            starts = list(accumulate(query_lens, initial=0))
        decode_ids = [i for i, q in enumerate(query_lens) if q == 1]
        prefill_ids = [i for i, q in enumerate(query_lens) if q > 1]
        if not decode_ids:  # a prefill-only step: nothing to select
            return cls(
                query_lens, seq_lens, starts, decode_ids, None, metadata.block_tables[:0], metadata.seq_lens[:0],
                prefill_ids,
            )
        if len(decode_ids) == len(query_lens):
            rows, tables, lens = None, metadata.block_tables, metadata.seq_lens
        else:
            rows = torch.tensor([starts[i] for i in decode_ids], dtype=torch.long, device=device)
            ids = torch.tensor(decode_ids, dtype=torch.long, device=metadata.block_tables.device)
            tables = metadata.block_tables[ids]
            lens = torch.tensor([seq_lens[i] for i in decode_ids], dtype=torch.int32, device=device)
        return cls(query_lens, seq_lens, starts, decode_ids, rows, tables.int(), lens.int(), prefill_ids)


class TorchBackend:
    name = "torch"

    def __init__(self):
        self._plan: tuple[AttentionMetadata, _StepPlan] | None = None  # the current step's, by identity

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        key, value = to_cache_dtype(key, k_cache.dtype), to_cache_dtype(value, v_cache.dtype)  # rounded once here
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        k_flat = k_cache.view(num_slots, *k_cache.shape[2:])  # [num_slots, H_kv, D]
        v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
        if k_cache.dtype.itemsize == 1:  # index_copy_ has no fp8 kernels: copy the bytes
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            key, value = key.view(torch.uint8), value.view(torch.uint8)
        if slot_mapping.device.type != "cpu" or bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        k_flat.index_copy_(0, slot_mapping, key)
        v_flat.index_copy_(0, slot_mapping, value)

    def step_plan(self, metadata: AttentionMetadata, device: torch.device) -> _StepPlan:
        """The plan of the step `metadata` describes; the first layer builds it, the others reuse it.

        Only metadata carrying the host-side lengths (built afresh each step by the model runner, never
        changed after; see metadata.py) is reused by identity: a CUDA graph's metadata is one object whose
        tensors change in place between replays. The last step's metadata stays referenced until the next."""
        if metadata.query_lens_cpu is None or metadata.seq_lens_cpu is None:
            return _StepPlan.build(metadata, device)
        if self._plan is None or self._plan[0] is not metadata:
            self._plan = (metadata, _StepPlan.build(metadata, device))
        return self._plan[1]

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float, new_kv=None,
                sliding_window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None):
        plan = self.step_plan(metadata, query.device)
        mask = AttentionMask(scale, sliding_window, soft_cap, sinks)
        out = torch.empty_like(query)
        if plan.decode_ids:
            self._decode(query, k_cache, v_cache, plan, mask, out)
        if not plan.prefill_ids or self._prefill_all(query, k_cache, v_cache, metadata, plan, mask, out):
            return out
        for i in plan.prefill_ids:
            self._prefill_one(
                query, k_cache, v_cache, metadata, mask, i, plan.starts, plan.query_lens[i], plan.seq_lens[i], new_kv,
                out,
            )
        return out

    def _prefill_all(self, query, k_cache, v_cache, metadata, plan: _StepPlan, mask: AttentionMask, out) -> bool:
        """Attend every prompt chunk of the step at once into `out`, where a kernel can; False: one at a time."""
        return False

    def _decode(self, query, k_cache, v_cache, plan: _StepPlan, mask: AttentionMask, out):
        rows = plan.decode_rows
        q = query if rows is None else query[rows]  # [B, H_q, D]
        o = self._decode_attention(q, k_cache, v_cache, plan, mask)
        if rows is None:
            out.copy_(o)
        else:
            out[rows] = o

    def _decode_attention(self, q, k_cache, v_cache, plan: _StepPlan, mask: AttentionMask) -> torch.Tensor:
        """The decode sequences' attention [B, H_q, D] for their queries q [B, H_q, D]."""
        block_size = k_cache.shape[1]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        batch = q.shape[0]
        group = q.shape[1] // num_kv_heads
        lens = [plan.seq_lens[i] for i in plan.decode_ids]
        max_len = max(lens)
        num_blocks = -(-max_len // block_size)
        tables = plan.decode_tables[:, :num_blocks].long()
        offsets = torch.arange(block_size, device=q.device)
        slots = (tables.unsqueeze(-1) * block_size + offsets).view(batch, -1)[:, :max_len]  # [B, L]
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)  # [B, L, H_kv, D]
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)
        q = q.view(batch, num_kv_heads, group, head_dim)
        scores = mask.cap(torch.matmul(q, k.permute(0, 2, 3, 1)) * mask.scale)  # [B, H_kv, G, L]
        window = mask.sliding_window
        if min(lens) < max_len or (window is not None and max_len > window):
            lens_t = torch.tensor(lens, device=q.device)
            key_pos = torch.arange(max_len, device=q.device).unsqueeze(0)
            pad = key_pos >= lens_t.unsqueeze(1)  # [B, L]
            if window is not None:
                pad |= key_pos < lens_t.unsqueeze(1) - window  # behind the window: never read
            scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
            v = v.masked_fill(pad[:, :, None, None], 0)  # padded slots may be unwritten (NaN * 0 = NaN)
        probs = mask.softmax(scores.float().reshape(batch, -1, 1, max_len)).to(v.dtype)  # [B, H_q, 1, L]
        probs = probs.view(batch, num_kv_heads, group, max_len)
        return torch.matmul(probs, v.permute(0, 2, 1, 3)).reshape(batch, -1, head_dim)  # [B, H_q, D]

    def _prefill_one(self, query, k_cache, v_cache, metadata, mask: AttentionMask, i, starts, q_len, seq_len, new_kv,
                     out):
        start, end = starts[i], starts[i] + q_len
        q = query[start:end].transpose(0, 1)  # [H_q, q_len, D]
        if new_kv is not None and seq_len == q_len:
            k, v = new_kv[0][start:end], new_kv[1][start:end]  # no cached prefix: read this step's keys
            if k_cache.dtype != k.dtype:
                # Rounded as the cache holds them, so a prompt attends alike whether or not its prefix was
                # cached (and alike on every backend, which all read the cache).
                k = to_cache_dtype(k, k_cache.dtype).to(query.dtype)
                v = to_cache_dtype(v, v_cache.dtype).to(query.dtype)
        else:
            block_size = k_cache.shape[1]
            num_blocks = -(-seq_len // block_size)
            table = metadata.block_tables[i, :num_blocks].long()
            slots = (table.unsqueeze(-1) * block_size + torch.arange(block_size, device=query.device)).view(-1)
            slots = slots[:seq_len]
            k = k_cache.view(-1, *k_cache.shape[2:])[slots].to(query.dtype)
            v = v_cache.view(-1, *v_cache.shape[2:])[slots].to(query.dtype)
        # 4-D [1, H, L, D]: on CPU only 4-D inputs reach torch's flash kernel; 3-D ones take the math path,
        # which builds the causal mask and the full score matrix (3-5x slower at 256-1024 tokens).
        q, k, v = q.unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if mask.soft_cap is not None or mask.sinks is not None:
            o = _eager_attention(q, k, v, mask, seq_len)  # SDPA has neither soft caps nor sinks
        elif seq_len == q_len and mask.sliding_window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=mask.scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.visible(q_len, seq_len, query.device),
                                               scale=mask.scale, enable_gqa=True)  # fmt: skip
        out[start:end] = o[0].transpose(0, 1)


@dataclass(frozen=True)
class AttentionMask:
    """What a layer's attention sees and how it weighs it: the score scale, the sliding window (None: every
    earlier position), the soft cap on scores (None: none) and the attention sinks (float32 [H_q], None: none)."""

    scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: torch.Tensor | None = None

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """c * tanh(scores / c), in transformers' order (after the scale, before the mask)."""
        return scores if self.soft_cap is None else torch.tanh(scores / self.soft_cap) * self.soft_cap

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Softmax over the last dim of float32 scores [..., H_q, q_len, L] (heads third from the end), with each
        head's sink logit in the sum as transformers' eager gpt-oss attention adds it (a last column, dropped)."""
        if self.sinks is None:
            return torch.softmax(scores, dim=-1)
        sinks = self.sinks.float().reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]

    def visible(self, q_len: int, seq_len: int, device) -> torch.Tensor:
        """[q_len, seq_len] bool: may query j (at position seq_len - q_len + j) read key position k?"""
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
        visible = k_pos <= q_pos  # bottom-right aligned causal mask
        if self.sliding_window is not None:
            visible &= k_pos > q_pos - self.sliding_window
        return visible


def _eager_attention(q, k, v, mask: AttentionMask, seq_len: int) -> torch.Tensor:
    """Attention with soft-capped scores or sinks, as transformers' eager attention computes it: [1, H_q, q_len, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = mask.cap(torch.matmul(q, k.transpose(-1, -2)) * mask.scale)
    scores = scores.masked_fill(~mask.visible(q.shape[2], seq_len, q.device), float("-inf"))
    return torch.matmul(mask.softmax(scores.float()).to(q.dtype), v)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded into a KV cache of `dtype`, as the C++ store rounds it. fp8 (scale 1) saturates at the largest
    finite value, as vLLM's caches do: e4m3's cast already saturates, e5m2's would give inf."""
    if dtype == torch.float8_e5m2:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)
