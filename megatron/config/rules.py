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
from megatron.config.deepspeed_json import build_ds_config, with_ds_json
from megatron.config.lr_schedule import schedule_steps
from megatron.config.rules_logging import validate_logging
from megatron.config.rules_moe import validate_moe
from megatron.config.schema import (
    ConfigError,
    DataConfig,
    MegatronConfig,
    ModelConfig,
    OptimizerConfig,
    TrainingConfig,
    parse_blend,
    split_weights,
)
from megatron.config.schema_corpora import parse_corpus_list
from megatron.config.tokenizer_files import validate_vocab


def _fail(flag: str, problem: str, fix: str) -> None:
    raise ConfigError(f"{flag}: {problem}. Fix: {fix}.")


def validate_model(m: ModelConfig, tp: int = 1) -> None:
    """Shape rules of the model alone (and of its split over `tp` tensor-parallel ranks); each
    setting's own limits are declared with it (megatron.config.schema)."""
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        _fail(
            "--hidden-size",
            f"{m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
            "choose a hidden size that is a multiple of the head count (or set --kv-channels)",
        )
    if m.num_attention_heads % tp:
        _fail(
            "--num-attention-heads",
            f"{m.num_attention_heads} heads cannot be split over --tensor-model-parallel-size {tp}",
            "use a head count divisible by the tensor-parallel size, or a smaller TP size",
        )
    if m.num_query_groups is not None:
        if m.num_attention_heads % m.num_query_groups:
            _fail(
                "--num-query-groups",
                f"{m.num_query_groups} does not divide "
                f"--num-attention-heads {m.num_attention_heads}",
                "use a group count that divides the number of heads",
            )
        if m.num_query_groups % tp:
            _fail(
                "--num-query-groups",
                f"{m.num_query_groups} groups cannot be split over "
                f"--tensor-model-parallel-size {tp}",
                "use a group count divisible by the tensor-parallel size",
            )
    if m.ffn_size % tp:
        _fail(
            "--ffn-hidden-size",
            f"{m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}",
            "choose an FFN size that is a multiple of the tensor-parallel size",
        )
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        _fail(
            "--position-embedding-type rope",
            f"head size {m.head_dim} is odd",
            "use an even head size",
        )
    if m.seq_length > m.max_positions:
        _fail(
            "--seq-length",
            f"{m.seq_length} exceeds --max-position-embeddings {m.max_positions}",
            "raise --max-position-embeddings to at least the sequence length",
        )
    _validate_v1_architecture(m)


def _validate_v1_architecture(m: ModelConfig) -> None:
    n = m.num_unique_layers
    if n is not None and not (n <= m.num_layers and m.num_layers % n == 0):
        _fail(
            "--num-unique-layers",
            f"{n} does not divide --num-layers {m.num_layers}",
            "use a divisor of the layer count (or drop it: no sharing)",
        )
    if m.openai_gelu and m.swiglu:
        _fail("--openai-gelu", "the MLP is --swiglu, which has no GeLU", "drop one of them")


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
    if purpose == "inference":
        _validate_one_replica(cfg)
        return cfg
    _validate_settings(cfg)
    if purpose in _TRAINING:
        _validate_training(cfg)
    if purpose == "train-gpt":
        _refuse_bert_settings(cfg)
    if purpose in _BERT:
        _validate_bert(cfg)
    if purpose in _TRAINING and cfg.deepspeed.enabled:
        cfg = with_ds_json(cfg)
        build_ds_config(cfg)  # its rules, before any process group exists
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
        _fail("--fp16/--bf16", "both are set", "choose one")


def _validate_settings(cfg: MegatronConfig) -> None:
    """Every cross-group rule; raises ConfigError on the first broken one."""
    par, m = cfg.parallel, cfg.model
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if par.world_size % (tp * pp):
        _fail(
            "--tensor-model-parallel-size/--pipeline-model-parallel-size",
            f"world size {par.world_size} is not divisible by TP x PP = {tp} x {pp}",
            "launch a multiple of TP x PP processes or change the parallel sizes",
        )
    validate_model(m, tp)
    validate_moe(cfg)
    _validate_context_parallel(cfg)
    _validate_sequence_parallel(cfg)
    if m.num_layers % pp:
        _fail(
            "--pipeline-model-parallel-size",
            f"--num-layers {m.num_layers} does not divide into {pp} pipeline stages",
            "use a layer count divisible by the pipeline-parallel size",
        )
    vlayers = par.num_layers_per_virtual_pipeline_stage
    if vlayers is not None:
        if pp < 2:
            _fail(
                "--num-layers-per-virtual-pipeline-stage",
                "the interleaved schedule needs --pipeline-model-parallel-size of 2 or more",
                "drop the flag or raise the pipeline-parallel size",
            )
        if (m.num_layers // pp) % vlayers:
            _fail(
                "--num-layers-per-virtual-pipeline-stage",
                f"{vlayers} does not divide the {m.num_layers // pp} layers of each pipeline stage",
                "choose a divisor of num-layers / pipeline-model-parallel-size",
            )
    if cfg.precision.fp16 and cfg.precision.bf16:
        _fail("--fp16/--bf16", "both are set", "choose one mixed-precision mode")
    problem = layer_sharing_problem(m, pp, vlayers)
    if problem:
        _fail(
            "--num-unique-layers/--param-sharing-style",
            f"{problem} (--pipeline-model-parallel-size {pp})",
            "use --param-sharing-style spaced with --num-unique-layers a multiple of the "
            "number of model chunks, or no pipeline parallelism",
        )
    _validate_v1_kernels(cfg)
    _validate_batch(cfg.training, par.data_parallel_size)
    _validate_data(cfg.data)
    _validate_distributed_optimizer(cfg)
    validate_compat(cfg)


def _validate_distributed_optimizer(cfg: MegatronConfig) -> None:
    o = cfg.optimizer
    if o.use_distributed_optimizer and cfg.deepspeed.enabled:
        _fail(
            "--use-distributed-optimizer",
            "our sharded optimizer cannot run inside --deepspeed, whose ZeRO shards the "
            "optimizer itself",
            "drop --use-distributed-optimizer and pass --zero-stage 1 (ZeRO-1 shards the "
            "optimizer states like it; 2 also shards gradients, 3 weights), or drop --deepspeed",
        )
    if o.use_distributed_optimizer:
        clash = (
            ("--DDP-impl torch", cfg.distributed.ddp_impl == "torch", "torch DDP all-reduces"),
            ("--cpu-optimizer", cfg.deepspeed.cpu_optimizer, "its shards stay on the device"),
            (
                "--allreduce-dtype params",
                cfg.distributed.allreduce_dtype == "params",
                "it reduce-scatters the fp32 buckets",
            ),
        )
        for flag, given, why in clash:
            if given:
                _fail(
                    "--use-distributed-optimizer",
                    f"given with {flag}: {why}, our sharded buffers are needed",
                    f"drop {flag} (or --use-distributed-optimizer)",
                )
    if o.overlap_param_gather and not o.use_distributed_optimizer:
        _fail(
            "--overlap-param-gather",
            "overlaps the all-gather of the distributed optimizer's weights, which is off",
            "add --use-distributed-optimizer or drop --overlap-param-gather",
        )


def _validate_v1_kernels(cfg: MegatronConfig) -> None:
    k = cfg.kernels
    if k.fp16_lm_cross_entropy and not (cfg.precision.fp16 or cfg.precision.bf16):
        _fail(
            "--fp16-lm-cross-entropy",
            "given without --fp16/--bf16: the logits are fp32 already",
            "add --fp16 (as Megatron-LM v1.x required) or drop the flag",
        )
    if k.fp16_lm_cross_entropy and k.cross_entropy_loss_fusion:
        _fail(
            "--fp16-lm-cross-entropy",
            "given with --cross-entropy-loss-fusion, whose kernel already keeps no fp32 logits "
            "(and accumulates in fp32)",
            "choose one of them",
        )


def _validate_sequence_parallel(cfg: MegatronConfig) -> None:
    """--sequence-parallel splits the sequence over the TP group: TP > 1 ranks and s % TP = 0."""
    if not cfg.parallel.sequence_parallel:
        return
    tp, s = cfg.parallel.tensor_model_parallel_size, cfg.model.seq_length
    if tp == 1:
        _fail(
            "--sequence-parallel",
            "needs --tensor-model-parallel-size > 1 (it splits the sequence over the TP ranks)",
            "drop --sequence-parallel or raise --tensor-model-parallel-size",
        )
    if s % tp:
        _fail(
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
        _fail(
            flag,
            f"world size {par.world_size} is not divisible by TP x CP x PP = {tp} x {cp} x {pp}",
            f"launch a multiple of {tp * cp * pp} processes or change the parallel sizes",
        )
    if s % (2 * cp):
        _fail(
            flag,
            f"--seq-length {s} is not divisible by 2 x CP = {2 * cp} (each sequence is cut into "
            "2 x CP equal chunks, two per rank, so every rank has the same causal work)",
            f"use a sequence length that is a multiple of {2 * cp} (e.g. "
            f"{s + 2 * cp - s % (2 * cp)}) or a smaller {flag}",
        )
    if par.sequence_parallel and (s // cp) % tp:
        _fail(
            "--sequence-parallel",
            f"the {s // cp} tokens each context-parallel rank holds (--seq-length {s} / CP {cp}) "
            f"are not divisible by --tensor-model-parallel-size {tp}",
            f"use a sequence length that is a multiple of {2 * cp * tp}",
        )
    refused = (
        (
            "--deepspeed",
            cfg.deepspeed.enabled,
            "DeepSpeed's engines know no context-parallel group (their ZeRO would reduce "
            "gradients over DP only)",
            "drop --deepspeed (the native backend's --use-distributed-optimizer shards the "
            "optimizer over DP x CP)",
        ),
        (
            "--reset-attention-mask",
            cfg.data.reset_attention_mask,
            "ring attention masks by chunk position only; document masks would need every "
            "rank's document ids in each block",
            "drop --reset-attention-mask (--reset-position-ids and --eod-mask-loss work with CP)",
        ),
        (
            "--attention-backend fused",
            cfg.kernels.attention_backend == "fused",
            "the Triton causal softmax needs the whole score row; ring attention merges "
            "per-block softmaxes by their log-sum-exp",
            "pass --attention-backend sdpa (each block through SDPA's fused kernels) or "
            "unfused (explicit fp32 math per block)",
        ),
    )
    for other, given, why, fix in refused:
        if given:
            _fail(flag, f"{cp} given with {other}: {why}", fix)


def _validate_data(d: DataConfig) -> None:
    problem = d.tokenizer.pretrained_problem()
    if problem:
        _fail(*problem)
    _validate_loose_json(d)
    separate = d.train_data_path or d.valid_data_path or d.test_data_path
    if d.data_path and separate:
        _fail(
            "--data-path",
            "given together with --train/valid/test-data-path",
            "use either --data-path with --split, or the three separate paths",
        )
    for flag, paths in (
        ("--data-path", d.data_path),
        ("--train-data-path", d.train_data_path),
        ("--valid-data-path", d.valid_data_path),
        ("--test-data-path", d.test_data_path),
    ):
        parse_blend(paths, flag)
    try:
        split_weights(d.split)
    except ValueError as e:
        _fail("--split", str(e), "pass three non-negative weights such as 969,30,1")
    if d.uses_documents and d.tokenizer.tokenizer_type is None:
        flag = next(
            f
            for f, on in (
                ("--reset-position-ids", d.reset_position_ids),
                ("--reset-attention-mask", d.reset_attention_mask),
                ("--eod-mask-loss", d.eod_mask_loss),
            )
            if on
        )
        _fail(
            flag,
            "needs the end-of-document id, which comes from the tokenizer, and no "
            "--tokenizer-type is set",
            "pass the --tokenizer-type the data was preprocessed with (NullTokenizer for "
            "pre-tokenized ids: its end-of-document id is --vocab-size)",
        )


def _validate_loose_json(d: DataConfig) -> None:
    """--train-data & co. (loose JSON, cached in --cache-dir) replace the mmap data flags."""
    lj = d.loose_json
    loose = [
        (f, v)
        for f, v in (
            ("--train-data", lj.train_data),
            ("--valid-data", lj.valid_data),
            ("--test-data", lj.test_data),
        )
        if v
    ]
    if not loose:
        return
    mmap = [
        (f, v)
        for f, v in (
            ("--data-path", d.data_path),
            ("--train-data-path", d.train_data_path),
            ("--valid-data-path", d.valid_data_path),
            ("--test-data-path", d.test_data_path),
        )
        if v
    ]
    if mmap:
        _fail(
            loose[0][0],
            f"given together with {mmap[0][0]}: one names loose JSON corpora to tokenize, the "
            "other preprocessed .bin/.idx prefixes",
            f"use either {loose[0][0]} (loose JSON) or {mmap[0][0]} (prefixes), not both",
        )
    if not lj.train_data:
        _fail(loose[0][0], "needs --train-data", "name the training corpus with --train-data")
    for flag, values in loose:
        try:
            parse_corpus_list(values, flag)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if not d.tokenizer.cache_dir:
        _fail(
            loose[0][0],
            "the corpora are tokenized once into --cache-dir, which is not set",
            "pass --cache-dir DIR (a directory every node can read)",
        )
    if d.tokenizer.tokenizer_type is None:
        _fail(
            loose[0][0],
            "loose JSON needs a tokenizer",
            "pass --tokenizer-type (with its --vocab-file etc.) or --tokenizer-model-type",
        )


def _validate_batch(t: TrainingConfig, dp: int) -> None:
    gbs = t.resolved_global_batch_size(dp)
    if gbs % (t.micro_batch_size * dp):
        _fail(
            "--global-batch-size",
            f"{gbs} is not divisible by --micro-batch-size {t.micro_batch_size} "
            f"x data-parallel size {dp}",
            f"use a multiple of {t.micro_batch_size * dp}",
        )


def _validate_training(cfg: MegatronConfig) -> None:
    """The rules that only a training run needs (pretrain_gpt2.py checks them at start-up)."""
    t, o, c = cfg.training, cfg.optimizer, cfg.checkpoint
    if (t.train_iters is None) == (t.train_samples is None):
        _fail(
            "--train-iters/--train-samples",
            "give exactly one of them",
            "pass --train-iters N (steps) or --train-samples N (samples)",
        )
    validate_logging(cfg.logging, cfg.parallel.world_size)
    if o.lr is None:
        _fail("--lr", "a positive peak learning rate is required", "pass e.g. --lr 1.5e-4")
    if o.min_lr > o.lr:
        _fail("--min-lr", f"{o.min_lr} is not in [0, --lr {o.lr}]", "lower --min-lr")
    _validate_lr_schedule(o, t, cfg.parallel.data_parallel_size)
    if o.override_lr_scheduler and o.use_checkpoint_lr_scheduler:
        _fail(
            "--override-lr-scheduler",
            "given with --use-checkpoint-lr-scheduler",
            "choose which schedule wins on resume",
        )
    if o.initial_loss_scale < o.min_loss_scale:
        _fail(
            "--initial-loss-scale/--min-loss-scale",
            "need 0 < min <= initial",
            "e.g. --initial-loss-scale 65536 --min-loss-scale 1",
        )
    if c.save_interval is not None and c.save is None:
        _fail("--save-interval", "given without --save", "pass --save DIR")
    if c.async_save and c.save is None:
        _fail("--async-save", "given without --save", "pass --save DIR")
    if c.async_save and cfg.deepspeed.enabled:
        _fail(
            "--async-save",
            "--deepspeed's engine writes its own checkpoints, synchronously",
            "drop --async-save (or --deepspeed)",
        )
    _validate_rampup(t, cfg.parallel.data_parallel_size)
    _validate_interleaved(cfg)
    validate_vocab(cfg)


def _validate_interleaved(cfg: MegatronConfig) -> None:
    """The interleaved schedule runs whole rounds of P micro batches, at every batch size of
    the run (the --rampup-batch-size steps included)."""
    par, t = cfg.parallel, cfg.training
    if par.num_layers_per_virtual_pipeline_stage is None:
        return
    dp, pp = par.data_parallel_size, par.pipeline_model_parallel_size
    unit = t.micro_batch_size * dp
    sizes = [t.resolved_global_batch_size(dp)]
    if t.rampup_batch_size is not None:
        sizes += list(t.rampup_batch_size[:2])  # START and INCREMENT
    for size in sizes:
        if (size // unit) % pp:
            _fail(
                "--num-layers-per-virtual-pipeline-stage",
                f"the interleaved schedule needs the number of micro batches per step "
                f"({size // unit} = batch {size} / (micro batch x DP)) to be a multiple of "
                f"--pipeline-model-parallel-size {pp}",
                "change --global-batch-size, --rampup-batch-size or --micro-batch-size",
            )


def _validate_rampup(t: TrainingConfig, dp: int) -> None:
    if t.rampup_batch_size is None:
        return
    start, incr, samples = t.rampup_batch_size
    unit = t.micro_batch_size * dp
    gbs = t.resolved_global_batch_size(dp)
    if t.train_samples is None:
        _fail(
            "--rampup-batch-size",
            "a batch-size ramp needs sample-based training",
            "use --train-samples (and --lr-decay-samples) instead of --train-iters",
        )
    if start < 1 or incr < 1 or samples < 0 or start > gbs or (gbs - start) % incr:
        _fail(
            "--rampup-batch-size",
            f"{start} {incr} {samples} does not step from START to "
            f"--global-batch-size {gbs} in whole INCREMENTs",
            "adjust START or INCREMENT",
        )
    if start % unit or incr % unit:
        _fail(
            "--rampup-batch-size",
            f"START and INCREMENT must be multiples of micro-batch x DP = {unit}",
            f"use multiples of {unit}",
        )


def _validate_lr_schedule(o: OptimizerConfig, t: TrainingConfig, dp: int) -> None:
    """The schedule flags: one mode (iterations or samples), one way to give the warmup, and
    lengths AnnealingLR can run (warmup shorter than the decay, WSD's anneal inside it)."""
    unit, other = ("iters", "samples") if t.train_iters is not None else ("samples", "iters")
    for stem in ("lr-decay", "lr-warmup", "lr-wsd-decay"):
        if getattr(o, f"{stem.replace('-', '_')}_{other}"):
            _fail(f"--{stem}-{other}", f"contradicts --train-{unit}", f"use --{stem}-{unit}")
    if o.warmup is not None and o.lr_warmup_fraction is not None:
        _fail("--warmup", "is the classic --lr-warmup-fraction; both are given", "pass one of them")
    fraction_flag = "--warmup" if o.warmup is not None else "--lr-warmup-fraction"
    if (o.lr_warmup_fraction is not None or o.warmup is not None) and o.lr_warmup_iters:
        _fail(fraction_flag, "given together with --lr-warmup-iters", "set the warmup one way")
    if (o.lr_warmup_fraction is not None or o.warmup is not None) and o.lr_warmup_samples:
        _fail(fraction_flag, "given together with --lr-warmup-samples", "set the warmup one way")
    steps = schedule_steps(o, t, t.resolved_global_batch_size(dp))
    warm, decay, wsd = steps["warmup_steps"], steps["decay_steps"], steps["wsd_decay_steps"]
    if o.lr_decay_style != "constant" and warm >= decay:
        _fail(
            f"--lr-warmup-{unit}/--lr-warmup-fraction",
            f"{warm} warmup steps are not fewer than the {decay} decay steps "
            f"(--lr-decay-{unit}, default --train-{unit})",
            "shorten the warmup or lengthen the decay (or use --lr-decay-style constant)",
        )
    if o.lr_decay_style == "WSD" and not (wsd is not None and 0 < wsd <= decay - warm):
        _fail(
            f"--lr-wsd-decay-{unit}",
            f"--lr-decay-style WSD needs it in (0, decay - warmup = {decay - warm}], got {wsd}",
            f"pass --lr-wsd-decay-{unit} within that range",
        )


def _validate_bert(cfg: MegatronConfig) -> None:
    """pretrain_bert.py's rules: what its model cannot do."""
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        _fail(
            "--num-layers-per-virtual-pipeline-stage",
            "BERT runs one model chunk per pipeline stage",
            "drop the flag",
        )
    if cfg.parallel.context_parallel_size > 1:
        _fail(
            "--context-parallel-size",
            "ring attention is causal (the GPT's); BERT attends both ways over its padded samples",
            "drop it (BERT's 512-token samples fit on one rank)",
        )
    if cfg.parallel.sequence_parallel:
        _fail(
            "--sequence-parallel",
            "the BERT model does not split its embeddings, pooler and heads along the sequence",
            "drop it (BERT-large fits without it; TP alone splits the layers)",
        )
    if cfg.model.num_unique_layers is not None:
        _fail(
            "--num-unique-layers",
            "layer sharing is built into the GPT's layer stack only",
            "drop it, or pretrain a GPT with pretrain_gpt2.py",
        )
    if cfg.model.untie_embeddings_and_output_weights:
        _fail("--untie-embeddings-and-output-weights", "BERT ties its MLM output", "drop it")
    if cfg.model.moe:
        _fail(
            "--num-experts",
            "mixture of experts is trained, logged and converted for the GPT only",
            "drop it, or pretrain an MoE GPT with pretrain_gpt2.py",
        )
    if cfg.data.uses_documents:
        _fail(
            "--reset-position-ids/--reset-attention-mask/--eod-mask-loss",
            "GPT's packed-document options; BERT samples hold one document",
            "drop them",
        )


def _refuse_bert_settings(cfg: MegatronConfig) -> None:
    """pretrain_gpt2.py: the BERT section's flags do nothing for a GPT, so they are refused."""
    if cfg.bert.changed:
        _fail(
            cfg.bert.changed[0],
            "a BERT pretraining setting; the GPT has no masked-LM or NSP objective",
            "drop it, or run pretrain_bert.py",
        )
