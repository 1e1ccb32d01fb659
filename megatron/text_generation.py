"""Greedy text generation from a (TP-split) GPTModel.

Every TP rank runs the same tokens; the vocab-split logits of the last position are gathered
over the TP group, so all ranks pick the same next token. The whole prefix is recomputed per
token (no KV cache yet), which is plenty for samples of a few dozen tokens.
"""

from __future__ import annotations

import torch

from megatron.mpu import gather_from_tensor_model_parallel_region


@torch.no_grad()
def generate_greedy(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    tp_group=None,
    eod: int | None = None,
    max_length: int | None = None,
) -> list[int]:
    """prompt + up to max_new_tokens greedy tokens (stops after `eod`)."""
    model.eval()
    device = next(model.parameters()).device
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        window = tokens[-max_length:] if max_length else tokens
        x = torch.tensor([window], dtype=torch.long, device=device)
        logits = model(x)[:, -1, :]  # (1, V_pad / p)
        full = gather_from_tensor_model_parallel_region(logits.float(), tp_group)
        next_id = int(full.argmax(dim=-1).item())
        tokens.append(next_id)
        if eod is not None and next_id == eod:
            break
    return tokens
