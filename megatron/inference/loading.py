"""Build a model for inference from a training checkpoint: shapes and tokenizer come from the
checkpoint's recorded arguments, so the user repeats none of the model flags."""

from __future__ import annotations

import dataclasses

from megatron.checkpoint.reading import load_shard, resolve_load_iteration
from megatron.checkpoint.storage import CheckpointError
from megatron.config.schema import model_config_from_saved
from megatron.config.schema_data import TokenizerConfig
from megatron.config.schema_kernels import KernelConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.fused_kernels import TORCH_OPS, select_ops
from megatron.model import families as registry
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize


def load_model_for_inference(
    load_dir: str,
    rt,
    dtype=None,
    kernels: KernelConfig | None = None,
    tokenizer: dict | None = None,
):
    """(model chunks, tokenizer or None, model config, iteration) for this rank's TP/PP
    position; `model[0]` is this stage's model (a causal LM family's). `kernels`: the run-time
    kernel switches (None: plain torch), never the ones a checkpoint from before they left
    ModelConfig holds.
    `dtype`: cast the weights (None: as saved). `tokenizer`: TokenizerConfig fields that
    replace the checkpoint's record (the command line's --vocab-file etc.)."""
    iteration = resolve_load_iteration(load_dir)
    if iteration is None:
        raise CheckpointError(f"--load {load_dir}: no checkpoint there")
    st = rt.state
    shard = load_shard(
        load_dir,
        iteration,
        tp_rank=st.tp_rank,
        pp_rank=st.pp_rank,
        pp_size=st.pp_size,
        map_location=rt.device,
    )
    args = shard["args"]
    saved_tp = args["tensor_model_parallel_size"]
    saved_pp = args["pipeline_model_parallel_size"]
    if (saved_tp, saved_pp) != (st.tp_size, st.pp_size):
        raise CheckpointError(
            f"--load {load_dir}: saved with TP={saved_tp} x PP={saved_pp}, but this run has "
            f"--tensor-model-parallel-size {st.tp_size} x --pipeline-model-parallel-size "
            f"{st.pp_size}. Fix: launch {saved_tp * saved_pp} processes with those sizes (or "
            "reshard it with tools/convert_checkpoint.py)"
        )
    spec = registry.spec_of_checkpoint_family(registry.checkpoint_family(shard["model"]))
    if not spec.causal_lm:
        raise CheckpointError(
            f"--load {load_dir}: a {spec.name} checkpoint; generation and language-model "
            "evaluation run causal language models only"
        )
    model_cfg = model_config_from_saved(args["model"])
    model_cfg = dataclasses.replace(model_cfg, hidden_dropout=0.0, attention_dropout=0.0)
    # The checkpoint holds the architecture only: the kernels come from the caller (plain torch
    # ops when it names none), recompute is a training setting. Weights are overwritten right
    # after, so the seed is moot.
    ctx = BuildContext(
        state=st,
        seed=0,
        device=rt.device,
        dtype=dtype or next(iter(shard["model"].values())).dtype,
        rng_tracker=rt.rng_tracker,
        ops=select_ops(kernels, rt.device) if kernels is not None else TORCH_OPS,
    )
    model = spec.model_provider(None)(model_cfg, ctx)  # the architecture alone
    compiled = kernels is not None and kernels.torch_compile
    backend = kernels.torch_compile_backend if compiled else "inductor"
    parallelize(model, st, torch_compile=compiled, compile_backend=backend)
    model.load_state_dict(shard["model"])
    tok = _build_tokenizer({**args.get("tokenizer", {}), **(tokenizer or {})}, model_cfg)
    return model, tok, model_cfg, iteration


def _build_tokenizer(fields: dict, model_cfg):
    """The tokenizer of the merged record, checked to fit the model's vocabulary."""
    tok_cfg = TokenizerConfig(**fields).with_pretrained_files()
    if not tok_cfg.tokenizer_type:
        return None
    tok = build_tokenizer(
        tok_cfg.tokenizer_type, vocab_size=model_cfg.vocab_size, **tok_cfg.kwargs()
    )
    if model_cfg.vocab_size is not None and tok.vocab_size > model_cfg.vocab_size:
        raise CheckpointError(
            f"--vocab-file {tok_cfg.vocab_file or tok_cfg.tokenizer_model}: {tok.vocab_size} "
            f"tokens, but the checkpoint's model has {model_cfg.vocab_size}. Fix: pass the "
            "tokenizer files the model was trained with"
        )
    return tok
