"""Text generation: greedy, top-k, top-p and temperature sampling with a KV cache, any TP x PP.

Prompts of different lengths run as one batch without padding masks (Megatron's way): all
sequences advance one position at a time from the shortest prompt's end, and where a position
is still inside a longer prompt, the prompt's token overwrites the sampled one. With the KV
cache the first step encodes the common prefix and each later step costs one position.
Sampling happens on every rank from the same broadcast logits and the same seeded generator,
so all ranks agree on every token without another broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.inference.engine import InferenceModel

# (position just written, that step's (b, V) logits, tokens (b, total)) -> rows to stop, or None
StepHook = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    greedy: bool = False
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 0.0  # 0: no nucleus filter
    temperature: float = 1.0
    seed: int = 1234
    stop_at_eod: bool = True

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """Next token per row of (b, V) float32 logits."""
    if params.greedy or params.top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= params.top_p  # keeps the first
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    engine: InferenceModel,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    eod: int | None = None,
    max_length: int | None = None,
    use_cache: bool = True,
    step_hook: StepHook | None = None,
) -> list[list[int]]:
    """prompt + generated ids for each prompt (generation of a row stops after its eod).

    `step_hook(pos, logits, tokens)`, if given, sees each step's (b, V) logits and the tokens
    so far (position `pos` just written) and may return a (b,) bool of rows to stop after
    `pos` (e.g. a stop sequence appeared); it must answer the same on every rank.
    """
    params.validate()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = engine.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    limit = max_length or engine.model.cfg.max_positions
    total = min(int(lengths.max()) + params.max_new_tokens, limit)
    if int(lengths.max()) > limit:
        raise ValueError(f"a prompt has {int(lengths.max())} tokens; the model takes {limit}")
    tokens = torch.full((len(prompts), total), eod if eod is not None else 0, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, device=device)
    positions = torch.arange(total, device=device).expand(len(prompts), total)
    caches = engine.new_caches(len(prompts), total) if use_cache else None
    generator = torch.Generator().manual_seed(params.seed)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    ends = torch.full_like(lengths, total)
    start = 0
    for pos in range(int(lengths.min()), total):
        window = slice(start, pos) if use_cache else slice(0, pos)
        logits = engine.next_token_logits(tokens[:, window], positions[:, window], caches)
        chosen = sample(logits, params, generator)
        in_prompt = pos < lengths
        chosen = torch.where(in_prompt, tokens[:, pos], chosen)
        chosen = torch.where(done, tokens[:, pos], chosen)
        tokens[:, pos] = chosen
        stop = step_hook(pos, logits, tokens) if step_hook is not None else None
        if stop is not None or (eod is not None and params.stop_at_eod):
            finished = torch.zeros_like(done) if stop is None else stop.to(device)
            if eod is not None and params.stop_at_eod:
                finished = finished | (chosen == eod)
            finished &= ~in_prompt & ~done
            ends = torch.where(finished, torch.full_like(ends, pos + 1), ends)
            done |= finished
            if bool(done.all()):
                break
        if use_cache:
            start = pos
    ends = torch.minimum(ends, lengths + params.max_new_tokens)  # per prompt, not per batch
    return [tokens[i, : int(ends[i])].tolist() for i in range(len(prompts))]


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
    """Greedy continuation of one prompt with a causal language model on one pipeline stage."""
    from megatron.mpu.parallel_state import single_process_state

    state = model.state if tp_group is not None else single_process_state()
    engine = InferenceModel([model], state, model.cfg.vocab_size, model.cfg.hidden_size)
    return generate(
        engine,
        [prompt_ids],
        SamplingParams(max_new_tokens, greedy=True),
        eod=eod,
        max_length=max_length,
    )[0]
