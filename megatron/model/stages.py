"""Pipeline stages: which slice of the layer list each (pipeline rank, model chunk) owns.

With P stages and V model chunks per stage (the interleaved schedule, or the V placement's
two), the L layers form P x V virtual stages of L / (P V) layers; which virtual stage chunk c of
stage s runs is the schedules' arithmetic (megatron.schedules.base.virtual_stage). The first
virtual stage adds the embedding, the last the final norm and head. Parameter names stay global
(`layers.7...` wherever layer 7 lives), so a checkpoint's names never depend on the layout.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.schedules.base import virtual_stage


def stage_layer_range(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    vp_size: int | None = None,
    vp_rank: int = 0,
    v_shape: bool = False,
) -> range:
    chunks = vp_size or 1
    per = num_layers // (pp_size * chunks)
    start = virtual_stage(pp_size, pp_rank, vp_rank, v_shape) * per
    return range(start, start + per)


class ModelChunks(nn.Module):
    """The model chunks of one pipeline rank (one chunk unless interleaved).

    Its state dict is the union of the chunks' (their names are global and never collide), so
    a shard looks the same whatever V is.
    """

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> nn.Module:
        return self.chunks[i]

    def forward(self, *args, **kwargs):
        if len(self.chunks) != 1:
            raise RuntimeError("call a chunk of an interleaved model, not the container")
        return self.chunks[0](*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        merged = {}
        for chunk in self.chunks:
            merged.update(chunk.state_dict())
        return merged

    def load_state_dict(self, state_dict, strict: bool = True):
        for chunk in self.chunks:
            own = chunk.state_dict().keys()
            chunk.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=strict)
        if strict:
            unused = set(state_dict) - {k for c in self.chunks for k in c.state_dict()}
            if unused:
                raise KeyError(f"checkpoint keys not in this stage: {sorted(unused)[:5]}")

    def word_embeddings_weight(self) -> torch.Tensor | None:
        """This rank's copy of the word embedding the first and last stage share (tied head,
        or multi-token prediction's input), if it is in the embedding group."""
        for chunk in (self.chunks[0], self.chunks[-1]):
            if chunk.shares_embedding and (chunk.pre_process or chunk.post_process):
                return chunk.word_embeddings_weight()
        return None
