"""A plain PyTorch GPT (no parallel layers, no SDPA) to check GPTModel against.

Written independently of megatron.model: separate q/k/v projections, explicit masked softmax,
RoPE by explicit rotation of (i, i + d/2) pairs, an unpadded vocabulary. `keep` is one mask
for every block or a list of one per block (sliding windows on some layers); a block's `sink`
(heads,) adds one logit per head to every softmax row (attention sinks).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RefRMSNorm(nn.Module):
    def __init__(self, h, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, base):
    # x: (b, heads, s, d)
    s, d = x.shape[-2], x.shape[-1]
    half = d // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freqs[None, :]  # (s, d/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class RefBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, nq, ng, d = c.hidden_size, c.num_attention_heads, c.query_groups, c.head_dim
        bias = c.add_bias_linear
        norm = (
            (lambda: RefRMSNorm(h, c.layernorm_epsilon))
            if c.normalization == "RMSNorm"
            else (lambda: nn.LayerNorm(h, eps=c.layernorm_epsilon))
        )
        self.c, self.nq, self.ng, self.d = c, nq, ng, d
        self.sink = None  # (nq,): an extra logit per head, its probability dropped
        self.ln1, self.ln2 = norm(), norm()
        self.q = nn.Linear(h, nq * d, bias=bias)
        self.k = nn.Linear(h, ng * d, bias=bias)
        self.v = nn.Linear(h, ng * d, bias=bias)
        self.o = nn.Linear(nq * d, h, bias=bias)
        if c.swiglu:
            self.gate = nn.Linear(h, c.ffn_size, bias=bias)
        self.up = nn.Linear(h, c.ffn_size, bias=bias)
        self.down = nn.Linear(c.ffn_size, h, bias=bias)

    def attention(self, x, keep=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.nq, self.d).transpose(1, 2)
        k = self.k(x).view(b, s, self.ng, self.d).transpose(1, 2)
        v = self.v(x).view(b, s, self.ng, self.d).transpose(1, 2)
        if self.c.position_embedding_type == "rope":
            q, k = rope(q, self.c.rotary_base), rope(k, self.c.rotary_base)
        rep = self.nq // self.ng  # query head i reads key/value head i // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        # keep (b, 1, s, s): True where query i sees key j (default causal)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1) if keep is None else ~keep
        scores = scores.masked_fill(mask, float("-inf"))
        if self.sink is None:
            probs = scores.softmax(-1)
        else:  # exp(x_j) / (exp(sink) + sum_k exp(x_k))
            top = torch.maximum(scores.amax(-1, keepdim=True), self.sink.view(1, -1, 1, 1))
            e = (scores - top).exp()
            probs = e / (e.sum(-1, keepdim=True) + (self.sink.view(1, -1, 1, 1) - top).exp())
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, self.nq * self.d))

    def forward(self, x, keep=None):
        x = x + self.attention(self.ln1(x), keep)
        y = self.ln2(x)
        inner = F.silu(self.gate(y)) * self.up(y) if self.c.swiglu else F.gelu(self.up(y))
        return x + self.down(inner)


class RefGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab_size, c.hidden_size)
        self.wpe = (
            nn.Embedding(c.max_positions, c.hidden_size)
            if c.position_embedding_type == "learned"
            else None
        )
        self.blocks = nn.ModuleList(RefBlock(c) for _ in range(c.num_layers))
        self.ln_f = (
            RefRMSNorm(c.hidden_size, c.layernorm_epsilon)
            if c.normalization == "RMSNorm"
            else nn.LayerNorm(c.hidden_size, eps=c.layernorm_epsilon)
        )
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if not c.untie_embeddings_and_output_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens, labels=None, keep=None):
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.size(1)))
        keeps = keep if isinstance(keep, list) else [keep] * len(self.blocks)
        for blk, blk_keep in zip(self.blocks, keeps, strict=True):
            x = blk(x, blk_keep)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(
            labels
        )


@torch.no_grad()
def load_from_megatron(ref: RefGPT, model) -> None:
    """Copy a TP=1 GPTModel's weights into the reference (unpacking the fused projections)."""
    c, sd = ref.c, model.state_dict()
    V = c.vocab_size
    ref.wte.weight.copy_(sd["embedding.word_embeddings.weight"][:V])
    if ref.wpe is not None:
        ref.wpe.weight.copy_(sd["embedding.position_embeddings.weight"])
    for i, blk in enumerate(ref.blocks):
        p = f"layers.{i}."
        qpg = c.num_attention_heads // c.query_groups
        # fused rows: (groups, [q_1..q_qpg, k, v], head_dim)
        w = sd[p + "self_attention.query_key_value.weight"].view(
            c.query_groups, qpg + 2, c.head_dim, -1
        )
        blk.q.weight.copy_(w[:, :qpg].reshape(-1, c.hidden_size))
        blk.k.weight.copy_(w[:, qpg].reshape(-1, c.hidden_size))
        blk.v.weight.copy_(w[:, qpg + 1].reshape(-1, c.hidden_size))
        blk.o.weight.copy_(sd[p + "self_attention.dense.weight"])
        fc1 = sd[p + "mlp.dense_h_to_4h.weight"]
        if c.swiglu:
            blk.gate.weight.copy_(fc1[: c.ffn_size])
            blk.up.weight.copy_(fc1[c.ffn_size :])
        else:
            blk.up.weight.copy_(fc1)
        blk.down.weight.copy_(sd[p + "mlp.dense_4h_to_h.weight"])
        if c.add_bias_linear:
            b = sd[p + "self_attention.query_key_value.bias"].view(c.query_groups, qpg + 2, -1)
            blk.q.bias.copy_(b[:, :qpg].reshape(-1))
            blk.k.bias.copy_(b[:, qpg].reshape(-1))
            blk.v.bias.copy_(b[:, qpg + 1].reshape(-1))
            blk.o.bias.copy_(sd[p + "self_attention.dense.bias"])
            fc1b = sd[p + "mlp.dense_h_to_4h.bias"]
            if c.swiglu:
                blk.gate.bias.copy_(fc1b[: c.ffn_size])
                blk.up.bias.copy_(fc1b[c.ffn_size :])
            else:
                blk.up.bias.copy_(fc1b)
            blk.down.bias.copy_(sd[p + "mlp.dense_4h_to_h.bias"])
        for ref_norm, ours in ((blk.ln1, "input_layernorm"), (blk.ln2, "post_attention_layernorm")):
            ref_norm.load_state_dict(
                {k[len(p + ours) + 1 :]: v for k, v in sd.items() if k.startswith(p + ours + ".")}
            )
    ref.ln_f.load_state_dict(
        {
            k[len("head.final_layernorm.") :]: v
            for k, v in sd.items()
            if k.startswith("head.final_layernorm.")
        }
    )
    if c.untie_embeddings_and_output_weights:
        ref.lm_head.weight.copy_(sd["head.output_layer.weight"][:V])
