"""Every rule between settings, checked once before any work, through one entry point:

    cfg = validate(cfg, purpose)

`purpose` says what the run will do: "config" (the settings alone: what parse_args checks for
every tool), "train-gpt" (pretrain_gpt2.py, pretrain(cfg)), "train-bert" (pretrain_bert.py),
"eval-bert" (tools/evaluate_bert.py) or "inference" (the generation and evaluation tools, whose
model comes from the checkpoint). The result is the resolved config: --tokenizer-model-type's
files found in --cache-dir, the --deepspeed_config JSON read (once; build_ds_config then checks
it against the flags before start-up). Validating a validated config changes nothing.

A setting's own limits and choices are declared with it (megatron.config.schema) and checked
whenever a section is built. Each broken rule raises `ConfigError` naming the flag and the fix
(never an `assert`, which `python -O` would remove).
"""

from __future__ import annotations

import dataclasses

from megatron.config.compat_v1 import V1_DEFAULT_TOKENIZER, validate_compat
from megatron.config.declare import ConfigError, fail
from megatron.config.deepspeed_json import build_ds_config, with_ds_json
from megatron.config.rules_bert import refuse_bert_settings, validate_bert
from megatron.config.rules_compute import validate_compute
from megatron.config.rules_data import validate_data
from megatron.config.rules_fp8 import validate_fp8
from megatron.config.rules_fsdp2 import validate_fsdp2
from megatron.config.rules_ft import validate_fault_tolerance
from megatron.config.rules_mla import validate_mla_model
from megatron.config.rules_moe import validate_moe
from megatron.config.rules_mtp import validate_mtp
from megatron.config.rules_pairs import refuse_pairs
from megatron.config.rules_pipeline import validate_pipeline_schedule
from megatron.config.rules_training import validate_batch, validate_training
from megatron.config.rules_window import (
    refuse_window_for_bert,
    validate_window_model,
    validate_window_parallel,
)
from megatron.config.schema import MegatronConfig, ModelConfig


def validate_model(m: ModelConfig, tp: int = 1) -> None:
    """Shape rules of the model alone (and of its split over `tp` tensor-parallel ranks); each
    setting's own limits are declared with it (megatron.config.schema)."""
    validate_mla_model(m, tp)
    validate_window_model(m)
    if (
        not m.multi_latent_attention
        and m.kv_channels is None
        and m.hidden_size % m.num_attention_heads
    ):
        fail(
            "--hidden-size",
            f"{m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
            "choose a hidden size that is a multiple of the head count (or set --kv-channels)",
        )
    if m.num_attention_heads % tp:
        fail(
            "--num-attention-heads",
            f"{m.num_attention_heads} heads cannot be split over --tensor-model-parallel-size {tp}",
            "use a head count divisible by the tensor-parallel size, or a smaller TP size",
        )
    if m.num_query_groups is not None:
        if m.num_attention_heads % m.num_query_groups:
            fail(
                "--num-query-groups",
                f"{m.num_query_groups} does not divide "
                f"--num-attention-heads {m.num_attention_heads}",
                "use a group count that divides the number of heads",
            )
        if m.num_query_groups % tp:
            fail(
                "--num-query-groups",
                f"{m.num_query_groups} groups cannot be split over "
                f"--tensor-model-parallel-size {tp}",
                "use a group count divisible by the tensor-parallel size",
            )
    if m.ffn_size % tp:
        fail(
            "--ffn-hidden-size",
            f"{m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}",
            "choose an FFN size that is a multiple of the tensor-parallel size",
        )
    if m.position_embedding_type == "rope" and m.head_dim % 2 and not m.multi_latent_attention:
        fail(
            "--position-embedding-type rope",
            f"head size {m.head_dim} is odd",
            "use an even head size",
        )
    if m.seq_length > m.max_positions:
        fail(
            "--seq-length",
            f"{m.seq_length} exceeds --max-position-embeddings {m.max_positions}",
            "raise --max-position-embeddings to at least the sequence length",
        )
    _validate_v1_architecture(m)


def _validate_v1_architecture(m: ModelConfig) -> None:
    n = m.num_unique_layers
    if n is not None and not (n <= m.num_layers and m.num_layers % n == 0):
        fail(
            "--num-unique-layers",
            f"{n} does not divide --num-layers {m.num_layers}",
            "use a divisor of the layer count (or drop it: no sharing)",
        )
    if m.openai_gelu and m.swiglu:
        fail("--openai-gelu", "the MLP is --swiglu, which has no GeLU", "drop one of them")


def layer_sharing_problem(m: ModelConfig, pp: int, vp_layers: int | None = None) -> str | None:
    """Why the shared layers (--num-unique-layers) cannot be split into `pp` stages (of
    `vp_layers`-layer model chunks), or None. A unique layer's weights live in one model chunk,
    so every layer that runs it must be in that chunk."""
    if not m.num_unique_layers or m.num_unique_layers == m.num_layers:
        return None
    per_chunk = vp_layers or m.num_layers // max(pp, 1)
    chunk_of: dict[int, int] = {}
    for i in range(m.num_layers):
        u, c = m.unique_layer(i), i // per_chunk
        if chunk_of.setdefault(u, c) != c:
            return (
                f"unique layer {u + 1} runs as layers {chunk_of[u] * per_chunk}.. and {i}, which "
                f"are in different pipeline model chunks of {per_chunk} layers; shared weights "
                "must stay on one stage"
            )
    return None


PURPOSES = ("config", "train-gpt", "train-bert", "eval-bert", "inference")
_TRAINING = ("train-gpt", "train-bert")
_BERT = ("train-bert", "eval-bert")


def validate(cfg: MegatronConfig, purpose: str = "config") -> MegatronConfig:
    """The resolved config for `purpose` (one of PURPOSES), or a ConfigError naming the first
    broken rule's flag and fix."""
    if purpose not in PURPOSES:
        raise ValueError(f"validate: unknown purpose {purpose!r}; use one of {PURPOSES}")
    cfg = _with_tokenizer_files(cfg, purpose)
    cfg = _expert_tp_default(cfg)
    if purpose == "inference":
        _validate_one_replica(cfg)
        return cfg
    _validate_settings(cfg)
    if purpose in _TRAINING:
        validate_training(cfg)
    if purpose == "train-gpt":
        refuse_bert_settings(cfg)
    if purpose in _BERT:
        validate_bert(cfg)
        refuse_window_for_bert(cfg.model)
    if purpose in _TRAINING and cfg.deepspeed.enabled:
        cfg = with_ds_json(cfg)
        build_ds_config(cfg)  # its rules, before any process group exists
    return cfg


def _expert_tp_default(cfg: MegatronConfig) -> MegatronConfig:
    """Under --deepspeed, MoE experts are replicated over TP unless --expert-tensor-parallel-size
    is given (Megatron-DeepSpeed's default); elsewhere Megatron-core's default, the TP size."""
    par = cfg.parallel
    if cfg.deepspeed.enabled and cfg.model.moe and par.expert_tensor_parallel_size is None:
        return cfg.replace(parallel=dataclasses.replace(par, expert_tensor_parallel_size=1))
    return cfg


def _with_tokenizer_files(cfg: MegatronConfig, purpose: str) -> MegatronConfig:
    """--tokenizer-model-type's files; the BERT tools' tokenizer when none is named (v1.1.5)."""
    tok = cfg.data.tokenizer.with_pretrained_files()
    if purpose in _BERT and tok.tokenizer_type is None:
        tok = dataclasses.replace(tok, tokenizer_type=V1_DEFAULT_TOKENIZER["bert"])
    if tok == cfg.data.tokenizer:
        return cfg
    return cfg.replace(data=dataclasses.replace(cfg.data, tokenizer=tok))


def _validate_one_replica(cfg: MegatronConfig) -> None:
    """Inference runs one model replica: TP x PP = the process count."""
    par = cfg.parallel
    tp, pp, world = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.world_size
    if world % pp:
        raise ConfigError(
            f"--pipeline-model-parallel-size {pp} does not divide the {world} processes. "
            "Fix: launch a multiple of the checkpoint's pipeline stages"
        )
    if tp * pp != world:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = "
            f"{tp * pp}, but {world} processes were launched; inference runs one model "
            f"replica. Fix: launch {tp * pp} processes (e.g. torchrun --nproc_per_node {tp * pp})"
        )
    if cfg.precision.fp16 and cfg.precision.bf16:
        fail("--fp16/--bf16", "both are set", "choose one")


def _validate_settings(cfg: MegatronConfig) -> None:
    """Every cross-group rule; raises ConfigError on the first broken one."""
    par, m = cfg.parallel, cfg.model
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if par.world_size % (tp * pp):
        fail(
            "--tensor-model-parallel-size/--pipeline-model-parallel-size",
            f"world size {par.world_size} is not divisible by TP x PP = {tp} x {pp}",
            "launch a multiple of TP x PP processes or change the parallel sizes",
        )
    validate_model(m, tp)
    validate_moe(cfg)
    validate_mtp(cfg)
    _validate_context_parallel(cfg)
    validate_window_parallel(cfg)
    _validate_sequence_parallel(cfg)
    if m.num_layers % pp:
        fail(
            "--pipeline-model-parallel-size",
            f"--num-layers {m.num_layers} does not divide into {pp} pipeline stages",
            "use a layer count divisible by the pipeline-parallel size",
        )
    vlayers = par.num_layers_per_virtual_pipeline_stage
    if vlayers is not None:
        if pp < 2:
            fail(
                "--num-layers-per-virtual-pipeline-stage",
                "the interleaved schedule needs --pipeline-model-parallel-size of 2 or more",
                "drop the flag or raise the pipeline-parallel size",
            )
        if (m.num_layers // pp) % vlayers:
            fail(
                "--num-layers-per-virtual-pipeline-stage",
                f"{vlayers} does not divide the {m.num_layers // pp} layers of each pipeline stage",
                "choose a divisor of num-layers / pipeline-model-parallel-size",
            )
    validate_pipeline_schedule(cfg)
    if cfg.precision.fp16 and cfg.precision.bf16:
        fail("--fp16/--bf16", "both are set", "choose one mixed-precision mode")
    validate_fp8(cfg)
    problem = layer_sharing_problem(m, pp, vlayers)
    if problem:
        fail(
            "--num-unique-layers/--param-sharing-style",
            f"{problem} (--pipeline-model-parallel-size {pp})",
            "use --param-sharing-style spaced with --num-unique-layers a multiple of the "
            "number of model chunks, or no pipeline parallelism",
        )
    validate_compute(cfg)
    refuse_pairs(cfg, "--cross-entropy-fusion-impl linear")  # megatron.config.rules_pairs
    validate_fault_tolerance(cfg)  # before the batch rules: its DP is the replica groups
    validate_batch(cfg.training, par.data_parallel_size)
    validate_data(cfg.data)
    _validate_distributed_optimizer(cfg)
    validate_fsdp2(cfg)
    validate_compat(cfg)


def _validate_distributed_optimizer(cfg: MegatronConfig) -> None:
    o = cfg.optimizer
    refuse_pairs(cfg, "--use-distributed-optimizer")  # megatron.config.rules_pairs
    if o.overlap_param_gather and not o.use_distributed_optimizer:
        fail(
            "--overlap-param-gather",
            "overlaps the all-gather of the distributed optimizer's weights, which is off",
            "add --use-distributed-optimizer or drop --overlap-param-gather",
        )


def _validate_sequence_parallel(cfg: MegatronConfig) -> None:
    """--sequence-parallel splits the sequence over the TP group: TP > 1 ranks and s % TP = 0."""
    if not cfg.parallel.sequence_parallel:
        return
    tp, s = cfg.parallel.tensor_model_parallel_size, cfg.model.seq_length
    if tp == 1:
        fail(
            "--sequence-parallel",
            "needs --tensor-model-parallel-size > 1 (it splits the sequence over the TP ranks)",
            "drop --sequence-parallel or raise --tensor-model-parallel-size",
        )
    if s % tp:
        fail(
            "--sequence-parallel",
            f"--seq-length {s} is not divisible by --tensor-model-parallel-size {tp}",
            f"use a sequence length that is a multiple of {tp} (e.g. {s + tp - s % tp}), or drop "
            "--sequence-parallel",
        )


def _validate_context_parallel(cfg: MegatronConfig) -> None:
    """--context-parallel-size: the world splits into it, the sequence into 2 x CP chunks, and
    the features that need the whole sequence on one rank are refused."""
    par, s = cfg.parallel, cfg.model.seq_length
    cp, tp, pp = (
        par.context_parallel_size,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
    )
    flag = "--context-parallel-size"
    if cp == 1:
        return
    if par.world_size % (tp * cp * pp):
        fail(
            flag,
            f"world size {par.world_size} is not divisible by TP x CP x PP = {tp} x {cp} x {pp}",
            f"launch a multiple of {tp * cp * pp} processes or change the parallel sizes",
        )
    if s % (2 * cp):
        fail(
            flag,
            f"--seq-length {s} is not divisible by 2 x CP = {2 * cp} (each sequence is cut into "
            "2 x CP equal chunks, two per rank, so every rank has the same causal work)",
            f"use a sequence length that is a multiple of {2 * cp} (e.g. "
            f"{s + 2 * cp - s % (2 * cp)}) or a smaller {flag}",
        )
    if par.sequence_parallel and (s // cp) % tp:
        fail(
            "--sequence-parallel",
            f"the {s // cp} tokens each context-parallel rank holds (--seq-length {s} / CP {cp}) "
            f"are not divisible by --tensor-model-parallel-size {tp}",
            f"use a sequence length that is a multiple of {2 * cp * tp}",
        )
    refuse_pairs(cfg, flag)  # --deepspeed, --attention-backend fused: megatron.config.rules_pairs
