"""The fast torch path (any device; the CPU default): batched decode over the paged cache, SDPA for prefill.

Decode sequences (query_len 1) go to the C++ kernel of cpu_ops.py on CPU (reads the cache in place),
elsewhere to one batched matmul over their gathered slots;
prefill chunks go one sequence at a time through SDPA (reading this step's keys directly when the
sequence has no cached prefix). Checked against reference.py in the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.cpu_ops import cpu_ops


class TorchBackend:
    name = "torch"

    def __init__(self, use_cpu_kernel: bool = True):
        self.use_cpu_kernel = use_cpu_kernel

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kernel = cpu_ops() if self.use_cpu_kernel and key.device.type == "cpu" else None
        if kernel is not None and key.dtype == k_cache.dtype and _rows_contiguous(key) and _rows_contiguous(value):
            kernel.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
            return
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        k_flat = k_cache.view(num_slots, *k_cache.shape[2:])  # [num_slots, H_kv, D]
        v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
        if slot_mapping.device.type != "cpu" or bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        k_flat.index_copy_(0, slot_mapping, key)
        v_flat.index_copy_(0, slot_mapping, value)

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float, new_kv=None):
        query_lens = metadata.query_lens_cpu
        seq_lens = metadata.seq_lens_cpu
        if query_lens is None or seq_lens is None:
            starts = metadata.query_start_loc.tolist()
            query_lens = [b - a for a, b in zip(starts, starts[1:])]
            seq_lens = metadata.seq_lens.tolist()
        out = torch.empty_like(query)
        decode_ids = [i for i, q in enumerate(query_lens) if q == 1]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        if decode_ids:
            self._decode(query, k_cache, v_cache, metadata, scale, decode_ids, starts, seq_lens, out)
        if len(decode_ids) < len(query_lens):
            for i, q_len in enumerate(query_lens):
                if q_len > 1:
                    self._prefill_one(
                        query, k_cache, v_cache, metadata, scale, i, starts, q_len, seq_lens[i], new_kv, out
                    )
        return out

    def _decode(self, query, k_cache, v_cache, metadata, scale, decode_ids, starts, seq_lens, out):
        block_size = k_cache.shape[1]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        all_decode = len(decode_ids) == len(seq_lens)
        token_ids = None if all_decode else torch.tensor([starts[i] for i in decode_ids], device=query.device)
        q = query if all_decode else query[token_ids]  # [B, H_q, D]
        batch = q.shape[0]
        group = q.shape[1] // num_kv_heads
        lens = [seq_lens[i] for i in decode_ids]
        kernel = cpu_ops() if self.use_cpu_kernel and query.device.type == "cpu" else None
        if kernel is not None and query.dtype in (torch.float32, torch.bfloat16):
            tables = metadata.block_tables if all_decode else metadata.block_tables[torch.tensor(decode_ids)]
            lens_t = metadata.seq_lens if all_decode else torch.tensor(lens, dtype=torch.int32)
            o = kernel.paged_decode(q.contiguous(), k_cache, v_cache, tables.int(), lens_t.int(), scale)
            if all_decode:
                out.copy_(o)
            else:
                out[token_ids] = o
            return
        max_len = max(lens)
        num_blocks = -(-max_len // block_size)
        tables = metadata.block_tables if all_decode else metadata.block_tables[torch.tensor(decode_ids)]
        tables = tables[:, :num_blocks].long()
        offsets = torch.arange(block_size, device=query.device)
        slots = (tables.unsqueeze(-1) * block_size + offsets).view(batch, -1)[:, :max_len]  # [B, L]
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots]  # [B, L, H_kv, D]
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots]
        q = q.view(batch, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [B, H_kv, G, L]
        if min(lens) < max_len:
            lens_t = torch.tensor(lens, device=query.device)
            pad = torch.arange(max_len, device=query.device).unsqueeze(0) >= lens_t.unsqueeze(1)  # [B, L]
            scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
            v = v.masked_fill(pad[:, :, None, None], 0)  # padded slots may be unwritten (NaN * 0 = NaN)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        o = torch.matmul(probs, v.permute(0, 2, 1, 3)).reshape(batch, -1, head_dim)  # [B, H_q, D]
        if all_decode:
            out.copy_(o)
        else:
            out[token_ids] = o

    def _prefill_one(self, query, k_cache, v_cache, metadata, scale, i, starts, q_len, seq_len, new_kv, out):
        start, end = starts[i], starts[i] + q_len
        q = query[start:end].transpose(0, 1)  # [H_q, q_len, D]
        if new_kv is not None and seq_len == q_len:
            k, v = new_kv[0][start:end], new_kv[1][start:end]  # no cached prefix: read this step's keys
        else:
            block_size = k_cache.shape[1]
            num_blocks = -(-seq_len // block_size)
            table = metadata.block_tables[i, :num_blocks].long()
            slots = (table.unsqueeze(-1) * block_size + torch.arange(block_size, device=query.device)).view(-1)
            slots = slots[:seq_len]
            k = k_cache.view(-1, *k_cache.shape[2:])[slots]
            v = v_cache.view(-1, *v_cache.shape[2:])[slots]
        # 4-D [1, H, L, D]: on CPU only 4-D inputs reach torch's flash kernel; 3-D ones take the math path,
        # which builds the causal mask and the full score matrix (3-5x slower at 256-1024 tokens).
        q, k, v = q.unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if seq_len == q_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Bottom-right aligned causal mask: query j sits at position seq_len - q_len + j.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose rows (H x D) are contiguous, at any row stride (views of the fused qkv output)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
