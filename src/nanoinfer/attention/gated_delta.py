"""Obviously correct torch versions of linear attention's two state-carrying ops (Gated DeltaNet: Qwen3-Next,
Qwen3.5): the short causal convolution and the gated delta rule. The plain-torch platform runs them; every fast
path (platforms/cpu, platforms/cuda) is tested against them. transformers' modeling_qwen3_next.py is the spec.

Layout (all platforms). Sequences lie back to back in the token dimension as for attention (AttentionMetadata's
query_start_loc); sequence i reads and writes slot state_slots[i] of the state cache (a negative slot: a padded
row of a CUDA graph, which reads and writes nothing). A sequence with context before this step
(seq_len > query_len) continues from its slot; one without starts from zeros, whatever the slot held.

    conv_state  [num_slots, channels, kernel_size - 1]   the last inputs of the convolution, the model's dtype
    ssm_state   [num_slots, num_v_heads, k_head_dim, v_head_dim]   the delta rule's state S, float32

The delta rule, per value head, with q and k L2-normalised and q scaled by k_head_dim ** -0.5:
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t
A step of one token runs it as written (the recurrent form); longer steps run it in chunks of CHUNK_SIZE tokens
(the chunked form: within a chunk, the updates solved as one triangular system), as transformers does for a
prompt, so their float32 results agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # transformers' and flash-linear-attention's chunk


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as transformers' (and flash-linear-attention's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def sequence_spans(metadata) -> list[tuple[int, int, bool]]:
    """(first row, rows, has context) of each sequence in a step, from the host copies of its lengths (read back
    from the device where a CUDA graph's metadata has none)."""
    query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    if query_lens is None or seq_lens is None:
        query_lens = metadata.query_start_loc.diff().tolist()
        seq_lens = metadata.seq_lens.tolist()
    spans, start = [], 0
    for query_len, seq_len in zip(query_lens, seq_lens):
        spans.append((start, query_len, seq_len > query_len))
        start += query_len
    return spans


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, metadata,
                  activation: str | None = "silu") -> torch.Tensor:  # fmt: skip
    """Depthwise causal convolution of each sequence's rows x [T, C] with weight [C, K], continuing from the K - 1
    inputs in its slot (zeros without context), then `activation`; the slot keeps the last K - 1 inputs.
    Returns [T, C] in x's dtype."""
    channels, width = weight.shape
    out = torch.empty_like(x)
    slots = metadata.state_slots.tolist()
    for (start, rows, has_context), slot in zip(sequence_spans(metadata), slots):
        if slot < 0:
            continue
        before = conv_state[slot] if has_context else conv_state.new_zeros(channels, width - 1)
        window = torch.cat([before, x[start : start + rows].t().to(conv_state.dtype)], dim=1)  # [C, K - 1 + rows]
        y = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=channels)[0]
        if activation == "silu":
            y = F.silu(y)
        out[start : start + rows] = y.t().to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - (width - 1) :]
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ssm_state: torch.Tensor, metadata) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over each sequence's rows: q, k [T, H_k, D_k] (not yet normalised), v [T, H_v, D_v],
    g (log decay, <= 0) and beta [T, H_v]; each of H_k heads serves H_v / H_k consecutive value heads. Continues
    from each sequence's slot of ssm_state (zeros without context) and leaves its final state there.
    Returns [T, H_v, D_v] in v's dtype."""
    out = torch.zeros_like(v)
    slots = metadata.state_slots.tolist()
    for (start, rows, has_context), slot in zip(sequence_spans(metadata), slots):
        if slot < 0:
            continue
        rows_of = slice(start, start + rows)
        state = ssm_state[slot].clone() if has_context else ssm_state.new_zeros(ssm_state.shape[1:])
        inputs = _prepare(q[rows_of], k[rows_of], v[rows_of], g[rows_of], beta[rows_of])
        if rows == 1 and has_context:
            o, state = recurrent_gated_delta_rule(*inputs, state)
        else:
            o, state = chunked_gated_delta_rule(*inputs, state)
            o = o.transpose(0, 1)
        out[rows_of] = o.to(v.dtype)
        ssm_state[slot] = state
    return out


def _prepare(q, k, v, g, beta):
    """float32 [H_v, rows, D] tensors (q and k normalised and repeated for their value heads, q scaled) and
    [H_v, rows] decays and betas."""
    ratio = v.shape[1] // k.shape[1]
    q, k = (l2norm(x.float()).repeat_interleave(ratio, dim=1) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return (*(x.transpose(0, 1) for x in (q, k, v.float())), g.float().t(), beta.float().t())


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """The rule token by token: q, k [H, n, D_k], v [H, n, D_v], g, beta [H, n], state [H, D_k, D_v] (float32).
    Returns (o [n, H, D_v], the final state)."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = (state * k[:, t, :, None]).sum(dim=1)  # S^T k, [H, D_v]
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        outputs.append((state * q[:, t, :, None]).sum(dim=1))
    return torch.stack(outputs, dim=0), state


def chunked_gated_delta_rule(q, k, v, g, beta, state):
    """The same rule CHUNK_SIZE tokens at a time: q, k [..., H, n, D_k], v [..., H, n, D_v], g, beta [..., H, n],
    state [..., H, D_k, D_v] (float32; any leading batch dims, e.g. sequences padded to one length, whose padding
    must have zero k, v and beta and zero g: it then leaves the state as it is). Returns (o [..., H, n, D_v], the
    final state).

    Within a chunk, with decays relative to its start (G_i = g_1 + ... + g_i), the updates' corrections u solve
    a unit lower-triangular system (I + A) u = beta (v - exp(G) S^T k) where A_ij = beta_i k_i.k_j exp(G_i - G_j)
    for j < i; the chunk's outputs read the state entering it plus the chunk's own corrections, and the state
    leaving it is that state decayed over the whole chunk plus the corrections' writes."""
    n = q.shape[-2]
    c = CHUNK_SIZE
    pad = (c - n % c) % c
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (n + pad) // c
    q, k, v = (x.reshape(*x.shape[:-2], num_chunks, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(*g.shape[:-1], num_chunks, c), beta.reshape(*beta.shape[:-1], num_chunks, c)
    decay = g.cumsum(dim=-1)  # G within each chunk
    strictly_upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(strictly_upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay  # its diagonal is ignored: the solve is unit triangular
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)  # fmt: skip
    scores = (q @ k.transpose(-1, -2)) * pair_decay  # within the chunk, causal
    q_in = q * decay.exp()[..., None]  # reading the state entering the chunk
    k_out = k * (decay[..., -1:] - decay).exp()[..., None]  # writing the state leaving it
    chunk_decay = decay[..., -1].exp()
    out = torch.empty_like(v)
    for i in range(num_chunks):
        corrections = values[..., i, :, :] - k_decayed[..., i, :, :] @ state
        out[..., i, :, :] = q_in[..., i, :, :] @ state + scores[..., i, :, :] @ corrections
        state = state * chunk_decay[..., i, None, None] + k_out[..., i, :, :].transpose(-1, -2) @ corrections
    out = out.reshape(*out.shape[:-3], num_chunks * c, out.shape[-1])[..., :n, :]
    return out, state
