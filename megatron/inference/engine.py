"""Forward passes for generation and evaluation on any TP x PP layout (DP = 1).

A forward runs the pipeline stage by stage (one micro batch): stage s receives the hidden
states from s - 1, runs its layers (with their KV caches when generating) and sends on; the
last stage turns them into logits. Results the caller needs everywhere (next-token logits,
per-token losses) are then broadcast from the last stage's TP rank 0 to every rank of the
model-parallel group, so all ranks see the same numbers and take the same decisions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.model.attention.mla import LatentKVCache
from megatron.model.attention.rolling_cache import RollingCache
from megatron.model.attention.standard import KVCache
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.mappings import gather_from_tensor_model_parallel_region
from megatron.mpu.parallel_state import ParallelState


class InferenceModel:
    def __init__(self, chunks, state: ParallelState, vocab_size: int, hidden_size: int):
        if state.cp_size != 1:
            raise ValueError(
                f"inference runs on the whole sequence (CP = 1): drop --context-parallel-size "
                f"{state.cp_size} (checkpoints do not depend on it) and launch TP x PP = "
                f"{state.tp_size * state.pp_size} processes"
            )
        if state.dp_size != 1:
            raise ValueError(
                f"inference runs one model replica (DP = 1); launch TP x PP = "
                f"{state.tp_size * state.pp_size} processes, not {state.world_size}"
            )
        self.chunks, self.state = chunks, state
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.model = chunks[0]  # inference uses one chunk per stage
        self.model.eval()
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @property
    def src_rank(self) -> int:
        """Global rank of TP rank 0 on the last pipeline stage (DP = 1)."""
        st = self.state
        return (st.pp_size - 1) * st.tp_size

    def new_caches(self, batch: int, max_length: int) -> dict[int, KVCache]:
        """One cache per layer run (shared weights or not): keys and values of this rank's
        key/value heads, or with multi-latent attention the compressed latent (every rank); a
        windowed layer's (--window-size) keeps its window only (RollingCache)."""
        cfg, at = self.model.cfg, (self.device, self.dtype)
        groups = cfg.query_groups // self.state.tp_size

        def full():
            if cfg.multi_latent_attention:
                return LatentKVCache(batch, max_length, cfg.kv_rank, cfg.qk_rope_dim, *at)
            return KVCache(batch, max_length, groups, cfg.head_dim, *at)

        runs = zip(self.model.layer_numbers, self.model.run_order(), strict=True)
        windows = {n: layer.self_attention.core.window for n, layer in runs}
        return {n: full() if w is None else RollingCache(w) for n, w in windows.items()}

    def _stage_forward(self, tokens, position_ids, caches, labels=None):
        """This stage's part of one forward; the last stage's output (logits or losses)."""
        st = self.state
        b, s = tokens.shape
        if not st.is_first_stage:
            x = torch.empty(b, s, self.hidden_size, device=self.device, dtype=self.dtype)
            dist.recv(x, st.prev_pp_rank)
            self.model.set_input_tensor(x)
        out = self.model(tokens, position_ids=position_ids, labels=labels, kv_caches=caches)
        if not st.is_last_stage:
            dist.send(out.contiguous(), st.next_pp_rank)
            return None
        return out

    def _broadcast(self, value: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        if self.state.world_size == 1:
            return value
        if value is None or self.state.rank != self.src_rank:
            value = torch.empty(shape, device=self.device, dtype=dtype)
        value = value.contiguous()
        dist.broadcast(value, self.src_rank, group=self.state.mp_group)
        return value

    def flag_from_rank0(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (one byte broadcast over the model-parallel group, which
        holds every rank as DP = 1); every rank must call it at the same point."""
        if self.state.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.uint8, device=self.device)
        dist.broadcast(value, 0, group=self.state.mp_group)
        return bool(value.item())

    @torch.no_grad()
    def next_token_logits(self, tokens, position_ids, caches=None) -> torch.Tensor:
        """(b, V) float32 logits of the position after `tokens`, the same on every rank."""
        out = self._stage_forward(tokens, position_ids, caches)
        logits = None
        if out is not None:
            last = out[:, -1, :].float()  # (b, V_pad / p)
            logits = gather_from_tensor_model_parallel_region(last, self.state.tp_group)
            logits = logits[:, : self.vocab_size]
        return self._broadcast(logits, (tokens.size(0), self.vocab_size), torch.float32)

    @torch.no_grad()
    def token_losses(self, tokens, labels, position_ids=None):
        """((b, s) float32 cross-entropy of `labels` given `tokens`, (b, s) argmax ids), the
        same on every rank. The vocab-split logits are never gathered."""
        if position_ids is None:
            position_ids = torch.arange(tokens.size(1), device=self.device).expand_as(tokens)
        out = self._stage_forward(tokens, position_ids, None)
        packed = None
        if out is not None:  # logits (b, s, V_pad / p)
            losses = vocab_parallel_cross_entropy(out, labels, self.state.tp_group).float()
            argmax = _vocab_parallel_argmax(out, self.state.tp_group)
            packed = torch.stack([losses, argmax.float()])  # ids < 2^24 are exact in fp32
        packed = self._broadcast(packed, (2, *tokens.shape), torch.float32)
        return packed[0], packed[1].long()

    @torch.no_grad()
    def token_logprobs(self, tokens, labels, top_n: int = 0):
        """log p(labels | tokens) (b, s) over the real vocab (padding ids excluded, as in the
        HF export), and the top_n most likely ids (b, s, n) with their log-probabilities, the
        same on every rank. The vocab-split logits are never gathered: each TP rank sends its
        own top_n only. A row may be right-padded: causal attention keeps padding out of the
        earlier positions."""
        position_ids = torch.arange(tokens.size(1), device=self.device).expand_as(tokens)
        out = self._stage_forward(tokens, position_ids, None)
        packed = None
        if out is not None:  # logits (b, s, V_pad / p)
            packed = _vocab_parallel_logprobs(out, labels, top_n, self.vocab_size, self.state)
        packed = self._broadcast(packed, (*tokens.shape, 1 + 2 * top_n), torch.float32)
        n = top_n
        return packed[..., 0], packed[..., 1 + n :].long(), packed[..., 1 : 1 + n]


def _vocab_parallel_argmax(logits: torch.Tensor, group) -> torch.Tensor:
    """Global argmax over a vocab split across TP: each rank's best, then the best of those."""
    local_max, local_idx = logits.float().max(dim=-1)  # (b, s)
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return local_idx
    offset = dist.get_rank(group) * logits.size(-1)
    both = torch.stack([local_max, (local_idx + offset).float()])  # (2, b, s)
    parts = [torch.empty_like(both) for _ in range(size)]
    dist.all_gather(parts, both, group=group)
    stacked = torch.stack(parts)  # (p, 2, b, s)
    best = stacked[:, 0].argmax(dim=0)  # first rank wins ties, like a single argmax
    return stacked[:, 1].gather(0, best.unsqueeze(0)).squeeze(0).long()


def _vocab_parallel_logprobs(logits, labels, top_n: int, vocab_size: int, state):
    """(b, s, 1 + 2 n) float32: log p(label), then the top n log-probabilities and their ids.

    log p(v) = z_v - logsumexp(z) with the logsumexp over the real vocab of every TP rank
    (max and sum of exp all-reduced); each rank's top n are all-gathered and the best n kept.
    """
    group = state.tp_group
    size = 1 if group is None else dist.get_world_size(group)
    z = logits.float()  # (b, s, V_pad / p)
    width = z.size(-1)
    offset = (0 if group is None else dist.get_rank(group)) * width
    ids = torch.arange(offset, offset + width, device=z.device)
    z = z.masked_fill(ids >= vocab_size, float("-inf"))  # padding rows never count
    zmax = z.max(dim=-1, keepdim=True).values  # (b, s, 1)
    if size > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    sumexp = (z - zmax).exp().sum(dim=-1, keepdim=True)
    local = labels - offset
    mine = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)  # (b, s)
    picked = torch.where(mine, picked, torch.zeros_like(picked))
    if size > 1:
        dist.all_reduce(sumexp, group=group)
        dist.all_reduce(picked, group=group)
    lse = zmax + sumexp.log()  # (b, s, 1)
    parts = [picked.unsqueeze(-1) - lse]  # (b, s, 1)
    if top_n > 0:
        values, idx = z.topk(min(top_n, width), dim=-1)  # (b, s, n)
        both = torch.stack([values, (idx + offset).float()])  # (2, b, s, n); ids exact in fp32
        if size > 1:
            gathered = [torch.empty_like(both) for _ in range(size)]
            dist.all_gather(gathered, both, group=group)
            both = torch.cat(gathered, dim=-1)  # (2, b, s, p n)
        best, order = both[0].topk(top_n, dim=-1)  # (b, s, n)
        parts += [best - lse, both[1].gather(-1, order)]
    return torch.cat(parts, dim=-1)  # (b, s, 1 + 2 n): log p(label), top log p, top ids


def load_inference_model(
    load_dir: str, rt, dtype=None, tokenizer: dict | None = None
) -> tuple[InferenceModel, object, int]:
    """(engine, tokenizer or None, checkpoint iteration) for this rank's TP/PP position;
    `dtype` and `tokenizer` as in load_model_for_inference."""
    from megatron.inference.loading import load_model_for_inference

    chunks, tokenizer, model_cfg, iteration = load_model_for_inference(
        load_dir, rt, dtype=dtype, tokenizer=tokenizer
    )
    engine = InferenceModel(chunks, rt.state, model_cfg.vocab_size, model_cfg.hidden_size)
    return engine, tokenizer, iteration


def broadcast_json(obj, device, src: int = 0):
    """Send a JSON-able value from global rank `src` to every rank (prompts, requests, stop).

    JSON bytes in a tensor, not pickle: nothing a peer sends is ever executed.
    """
    import json

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    if dist.get_rank() == src:
        payload = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src)
    return json.loads(bytes(payload.cpu().tolist()).decode())
