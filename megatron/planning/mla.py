"""Multi-latent attention in the planner: parameters, activations kept for backward, KV cache.

Per token, with n heads over t TP ranks, query/key head size d_qk = d_n + d_r, value head size
d_v, latents R_q (0 without --q-lora-rank) and R, D bytes per activation element:

    parameters     h R_q + R_q n d_qk / t (or h n d_qk / t) + h (R + d_r) + R n (d_n + d_v) / t
                   + n d_v h / t + the latent norms (R_q, R; twice with LayerNorm)
    latents        (8 + D) (R_q + R) + 4 per latent norm, on this rank's s / t tokens with SP:
                   each norm keeps its fp32 input and normed product and hands a D output on
                   (in fp32 the input aliases the down projection's output, whose k_r part
                   then stays too: 4 d_r)
    RoPE tables    4 d_r D: the cos / sin rows of the queries' and the key's positions
    heads          D n (3 w + d_v) / t with w = max(d_qk, d_v): the query, key and (padded)
                   value heads the kernel keeps, the output of the heads into dense
    core           D n w / t + 4 n / t: the kernel's output and log-sum-exp (flash SDPA; the
                   ring's under CP); dropped by selective recompute
    KV cache       (R + d_r) D per token and layer, whole on every TP rank

Checked against the bytes autograd holds for one MLA layer (tests/planning/test_mla.py).
"""

from __future__ import annotations

from megatron.config.schema import ModelConfig


def attention_params(m: ModelConfig, tp: int) -> int:
    """MLA's weights on one TP rank (its down projections and latent norms whole)."""
    h, n = m.hidden_size, m.num_attention_heads
    d_qk = m.qk_nope_dim + m.qk_rope_dim
    norm = 2 if m.normalization == "LayerNorm" else 1
    if m.q_lora_rank is None:
        q = h * n * d_qk // tp
    else:
        q = h * m.q_lora_rank + norm * m.q_lora_rank + m.q_lora_rank * n * d_qk // tp
    kv = h * (m.kv_rank + m.qk_rope_dim) + norm * m.kv_rank
    kv += m.kv_rank * n * (m.qk_nope_dim + m.v_dim) // tp
    out = n * m.v_dim // tp * h + h * int(m.add_bias_linear)
    return q + kv + out


def activation_bytes(
    m: ModelConfig, tokens: int, tp: int, sp: int, dtype_bytes: int, core: bool = True
) -> int:
    """Bytes MLA keeps for backward for `tokens` (s b) tokens of this rank: its latents (on
    tokens / sp), RoPE tables and heads; `core`: the kernel's own (not under selective
    recompute)."""
    D, n = dtype_bytes, m.num_attention_heads // tp
    latent_sizes = m.kv_rank + (m.q_lora_rank or 0)
    norms = 2 if m.q_lora_rank is not None else 1
    latent = (8 + D) * latent_sizes + 4 * norms + (4 * m.qk_rope_dim if D == 4 else 0)
    width = max(m.qk_nope_dim + m.qk_rope_dim, m.v_dim)
    heads = D * n * (3 * width + m.v_dim) + 4 * m.qk_rope_dim * D
    kernel = D * n * width + 4 * n if core else 0
    return latent * tokens // sp + (heads + kernel) * tokens


def kv_cache_bytes_per_token(m: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of generation's KV cache per token, all layers, on one TP rank: the latent and
    the RoPE key (MLA, whole on every rank), else keys and values of the rank's groups."""
    if m.multi_latent_attention:
        per_layer = m.kv_rank + m.qk_rope_dim
    else:
        per_layer = 2 * (m.query_groups // tp) * m.head_dim
    return m.num_layers * per_layer * dtype_bytes


def attention_flops(m: ModelConfig, seq: int, keys: int | None = None) -> int:
    """Matmul FLOPs of one MLA layer's forward on one sequence: 2 s x the projections' weights
    (down, up, output), the scores 2 s^2 n d_qk and the weighted sum 2 s^2 n d_v (s `keys`
    per query instead of s for a windowed layer)."""
    h, n = m.hidden_size, m.num_attention_heads
    d_qk = m.qk_nope_dim + m.qk_rope_dim
    if m.q_lora_rank is None:
        q = h * n * d_qk
    else:
        q = h * m.q_lora_rank + m.q_lora_rank * n * d_qk
    kv = h * (m.kv_rank + m.qk_rope_dim) + m.kv_rank * n * (m.qk_nope_dim + m.v_dim)
    weights = q + kv + n * m.v_dim * h
    keys = seq if keys is None else keys
    return 2 * seq * weights + 2 * seq * keys * n * (d_qk + m.v_dim)


def core_flops(m: ModelConfig, micro_batch: int) -> int:
    """Scores and weighted sum of one layer's forward over `micro_batch` sequences."""
    d = m.qk_nope_dim + m.qk_rope_dim + m.v_dim
    return 2 * micro_batch * m.seq_length**2 * m.num_attention_heads * d


def ring_kv_width(m: ModelConfig) -> int:
    """Elements per token of the K/V block ring attention passes (all heads, before TP): the
    up-projected keys and the values, both at the padded head size."""
    return 2 * m.num_attention_heads * max(m.qk_nope_dim + m.qk_rope_dim, m.v_dim)
