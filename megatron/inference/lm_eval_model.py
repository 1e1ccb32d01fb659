"""The lm-evaluation-harness model "megatron": loglikelihood, loglikelihood_rolling and
generate_until on a checkpoint, on any TP x PP layout (run through tools/lm_eval.py).

Rank 0 runs lm-eval; the other ranks follow it (ops.follow) and take part in every forward.
Importing this module imports lm_eval and registers the model; nothing else imports it.

- loglikelihood: lm-eval's own context / continuation split (TemplateLM), the sequence cut to
  the last max_length + 1 tokens as lm-eval's hf model does; log p over the real vocab (as the
  HF export), greedy = every continuation token is the argmax.
- loglikelihood_rolling, rolling=lm-eval (default): lm-eval's disjoint windows with the end
  of document token in front, so the first token is scored too (what lm-eval's hf model does).
  rolling=megatron: tools/evaluate.py's scheme (no prefix, the first token is context, windows
  of max_length moved by overlapping_eval), so the perplexity equals evaluate.py's.
- generate_until: sampling from gen_kwargs (greedy unless do_sample with temperature > 0),
  stopping at any `until` string or the end of document token, at most max_gen_toks tokens.
"""

from __future__ import annotations

import sys

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from megatron.inference.evaluation import window_plan
from megatron.inference.ops import Leader, Model, follow
from megatron.inference.session import setup

_LEADERS: dict[tuple[str, int], Leader] = {}
CHUNK = 256  # sequences per operation sent to the ranks


def start(load: str, pipeline_model_parallel_size: int = 1) -> Leader | None:
    """Set up this rank; rank 0 gets the Leader (kept for MegatronLM), the others follow rank 0
    until it stops them and get None."""
    rt, engine, tokenizer, _ = setup(load, pipeline_model_parallel_size)
    model = Model(engine, tokenizer)
    if rt.state.rank != 0:
        follow(model, rt.device, rt.state.rank)
        return None
    leader = Leader(model, rt.device)
    _LEADERS[(load, pipeline_model_parallel_size)] = leader
    return leader


def _int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--model_args {name}={value!r}: expected an integer") from None


@register_model("megatron")
class MegatronLM(TemplateLM):
    def __init__(
        self,
        load: str,
        pipeline_model_parallel_size=1,
        batch_size=8,
        max_length=None,
        max_gen_toks=256,
        rolling: str = "lm-eval",
        overlapping_eval=None,
        seed=1234,
        device=None,  # noqa: ARG002 - the launcher decides (LOCAL_RANK's GPU, or the CPU)
        max_batch_size=None,  # noqa: ARG002 - batch_size is never "auto" here
    ):
        super().__init__()
        pp = _int("pipeline_model_parallel_size", pipeline_model_parallel_size)
        leader = _LEADERS.get((load, pp)) or start(load, pp)
        if leader is None:  # only reachable when lm-eval runs on every rank
            raise ValueError("run lm-eval through tools/lm_eval.py for more than one process")
        self.leader, self.model = leader, leader.model
        self.tokenizer_ = self.model.tokenizer
        if str(batch_size).startswith("auto"):
            raise ValueError("--batch_size auto is not supported: give a number of sequences")
        self.batch_size = _int("batch_size", batch_size)
        limit = self.model.max_positions
        self._max_length = _int("max_length", max_length or limit)
        if not 1 < self._max_length <= limit:
            raise ValueError(f"--model_args max_length must be in [2, {limit}] for this model")
        self.max_gen_toks = _int("max_gen_toks", max_gen_toks)
        if rolling not in ("lm-eval", "megatron"):
            raise ValueError(f"--model_args rolling={rolling!r}: choose lm-eval or megatron")
        self.rolling = rolling
        self.stride = _int("overlapping_eval", overlapping_eval or self._max_length)
        self.seed = _int("seed", seed)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer_.tokenize(string)

    def _score(self, pairs: list[tuple[list[int], int]], progress: bool) -> list[tuple]:
        """(sum of log p, greedy) of the last n tokens of each (sequence, n)."""
        out = []
        bar = tqdm(total=len(pairs), disable=not progress, desc="scoring", file=sys.stderr)
        for i in range(0, len(pairs), CHUNK):
            part = pairs[i : i + CHUNK]
            args = {"sequences": [s for s, _ in part], "top_n": 1, "batch_size": self.batch_size}
            for (seq, n), r in zip(part, self.leader.run("score", args), strict=True):
                lps, tops = r["logprobs"][len(seq) - 1 - n :], r["top"][len(seq) - 1 - n :]
                greedy = all(top[0][0] == t for top, t in zip(tops, seq[-n:], strict=True))
                out.append((float(sum(lps)), greedy))
            bar.update(len(part))
        bar.close()
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = []
        for _, context, continuation in requests:
            seq = (context + continuation)[-(self.max_length + 1) :]
            pairs.append((seq, min(len(continuation), len(seq) - 1)))
        results = self._score(pairs, not disable_tqdm)
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def _rolling_pairs(self, tokens: list[int]) -> list[tuple[list[int], int]]:
        if self.rolling == "megatron":
            plan = window_plan(len(tokens), self.max_length, self.stride)
            return [(tokens[s : s + n + 1], n - first) for s, n, first in plan]
        windows = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
        return [(ctx + cont, len(cont)) for ctx, cont in map(make_disjoint_window, windows)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        per_doc = [self._rolling_pairs(self.tok_encode(req.args[0])) for req in requests]
        flat = self._score([p for doc in per_doc for p in doc], not disable_tqdm)
        out, at = [], 0
        for req, doc in zip(requests, per_doc, strict=True):
            total = sum(ll for ll, _ in flat[at : at + len(doc)])
            at += len(doc)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
            out.append(total)
        return out

    def _complete_args(self, contexts: list[str], kwargs: dict) -> dict:
        kwargs = dict(kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = _int("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        greedy = not kwargs.pop("do_sample", False) or temperature == 0.0
        top_p, top_k = float(kwargs.pop("top_p", 1.0) or 1.0), int(kwargs.pop("top_k", 0) or 0)
        if kwargs:
            raise ValueError(f"generate_until: unsupported generation arguments {sorted(kwargs)}")
        max_new = min(max_new, self.max_length - 1)
        keep = self.max_length - max_new  # left-truncate the context, as lm-eval's hf model
        return {
            "prompts": [self.tok_encode(c)[-keep:] or [self.eot_token_id] for c in contexts],
            "max_tokens": max_new,
            "stop": [s for s in until if s],
            "seed": self.seed,
            "logprobs": None,
            "greedy": greedy,
            "temperature": temperature or 1.0,
            "top_p": top_p if top_p < 1 else 0.0,
            "top_k": max(top_k, 0),
        }

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # requests with the same gen_kwargs batch together
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generating", file=sys.stderr)
        for rows in groups.values():
            for b in range(0, len(rows), self.batch_size):
                part = rows[b : b + self.batch_size]
                contexts = [requests[i].args[0] for i in part]
                args = self._complete_args(contexts, requests[part[0]].args[1])
                for i, r in zip(part, self.leader.run("complete", args), strict=True):
                    out[i] = r["text"]
                    self.cache_hook.add_partial("generate_until", requests[i].args, r["text"])
                bar.update(len(part))
        bar.close()
        return out
