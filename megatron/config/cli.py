"""Command-line flags (Megatron-LM's names) -> a validated `MegatronConfig`.

This is the only module that reads argv. Where Megatron renamed a flag, both spellings are
accepted as one option (`--model-parallel-size` = `--tensor-model-parallel-size`, `--batch-size`
= `--micro-batch-size`), so old launch scripts keep working.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from megatron.config.cli_train import (
    add_loop_args,
    add_training_run_args,
    fill,
    training_run_groups,
)
from megatron.config.rules import validate
from megatron.config.schema import (
    DataConfig,
    DistributedConfig,
    MegatronConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TokenizerConfig,
    TrainingConfig,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Megatron-style GPT pretraining (tensor x pipeline x data parallel)",
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_mixed_precision_args(parser)
    _add_distributed_args(parser)
    _add_data_args(parser)
    add_training_run_args(parser)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model", "shape and architecture (defaults are GPT-2's)")
    g.add_argument("--num-layers", type=int, default=2, help="transformer layers (default 2)")
    g.add_argument("--hidden-size", type=int, default=64, help="model width h (default 64)")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP inner width (default 4h; with --swiglu 2/3 x 4h rounded down to 64)",
    )
    g.add_argument("--num-attention-heads", type=int, default=4, help="query heads (default 4)")
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value heads for grouped-query attention (default: one per query head)",
    )
    g.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="size of each head (default hidden-size / num-attention-heads)",
    )
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample (default 128)")
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="rows of the learned position table (default: seq-length)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size when no tokenizer sets it (e.g. the null tokenizer)",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocab to a multiple of this x TP size (default 128); padding is masked out",
    )
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout on residual branches")
    g.add_argument(
        "--attention-dropout", type=float, default=0.1, help="dropout on attention probs"
    )
    g.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="std of the normal init (output projections get std / sqrt(2 x num-layers))",
    )
    g.add_argument(
        "--position-embedding-type",
        choices=["learned", "rope"],
        default="learned",
        help="learned absolute positions (GPT-2) or rotary embeddings",
    )
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base (default 10000)")
    g.add_argument(
        "--normalization",
        choices=["LayerNorm", "RMSNorm"],
        default="LayerNorm",
        help="normalization layer (default LayerNorm)",
    )
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5, help="norm epsilon (1e-5)")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument(
        "--disable-bias-linear", action="store_true", help="no bias in the linear layers"
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate output head instead of reusing the input embedding",
    )
    g = parser.add_argument_group("fused kernels", "Triton on CUDA, torch elsewhere")
    g.add_argument(
        "--attention-backend",
        choices=["sdpa", "fused", "unfused"],
        default="sdpa",
        help="sdpa: torch scaled_dot_product_attention (flash where available); "
        "fused: matmul + Triton scaled causal softmax; unfused: plain torch",
    )
    g.add_argument(
        "--no-masked-softmax-fusion",
        action="store_false",
        dest="masked_softmax_fusion",
        help="torch softmax in the fused backend",
    )
    g.add_argument(
        "--no-layer-norm-fusion",
        "--no-persist-layer-norm",
        action="store_false",
        dest="layer_norm_fusion",
        help="separate residual add and norm",
    )
    g.add_argument(
        "--no-bias-gelu-fusion",
        action="store_false",
        dest="bias_gelu_fusion",
        help="separate bias add and GeLU",
    )
    g.add_argument(
        "--no-bias-swiglu-fusion",
        action="store_false",
        dest="bias_swiglu_fusion",
        help="torch SwiGLU",
    )
    g.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="Triton vocab-parallel cross-entropy without fp32 logits",
    )
    g.add_argument(
        "--torch-compile", action="store_true", help="torch.compile each transformer layer"
    )
    g = parser.add_argument_group("activation checkpointing", "trade compute for memory")
    g.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="classic flag: --recompute-granularity full --recompute-method uniform",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="full: recompute whole layers in backward; selective: only the attention core",
    )
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default="uniform",
        help="full: checkpoint every group of N layers (uniform) or only the first "
        "N layers of each stage (block)",
    )
    g.add_argument(
        "--recompute-num-layers",
        "--checkpoint-num-layers",
        type=int,
        default=1,
        dest="recompute_num_layers",
        help="N for --recompute-method (1)",
    )


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallel", "ranks are laid out TP fastest, then DP, then PP")
    g.add_argument(
        "--tensor-model-parallel-size",
        "--model-parallel-size",
        type=int,
        default=1,
        dest="tensor_model_parallel_size",
        help="tensor-parallel ranks per layer (default 1)",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="pipeline stages (default 1)",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per model chunk for the interleaved pipeline schedule",
    )


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--seed", type=int, default=1234, help="base random seed (default 1234)")
    g.add_argument(
        "--micro-batch-size",
        "--batch-size",
        type=int,
        default=1,
        dest="micro_batch_size",
        help="samples per forward pass on one data-parallel rank (default 1)",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step over all data-parallel ranks "
        "(default micro-batch-size x DP; the rest is gradient accumulation)",
    )
    add_loop_args(g)


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true", help="fp16 weights/activations, loss scaling")
    g.add_argument("--bf16", action="store_true", help="bf16 weights/activations")


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="collective backend (default nccl on CUDA, gloo on CPU)",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="a collective that waits longer fails the job (default 10 minutes)",
    )
    g.add_argument(
        "--local-rank",
        "--local_rank",
        type=int,
        default=None,
        dest="local_rank",
        help="set by some launchers; LOCAL_RANK from the environment wins",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=40_000_000,
        help="gradient elements per data-parallel all-reduce bucket (40M)",
    )
    g.add_argument(
        "--no-overlap-grad-reduce",
        action="store_false",
        dest="overlap_grad_reduce",
        help="all-reduce gradients after backward instead of during it",
    )


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The tokenizer flags, shared with tools/preprocess_data.py and the other tools."""
    from megatron.data.tokenizers import TOKENIZER_TYPES

    g = parser.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="tokenizer kind (e.g. GPT2BPETokenizer)",
    )
    g.add_argument(
        "--vocab-file",
        default=None,
        help="vocab.json (GPT-2 BPE / whitespace vocab) or vocab.txt (BERT WordPiece)",
    )
    g.add_argument("--merge-file", default=None, help="merges.txt of a GPT-2 BPE tokenizer")
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="tokenizer.json (or its directory) for HuggingFaceTokenizer, "
        ".model for SentencePieceTokenizer",
    )
    return g


def tokenizer_config(ns: argparse.Namespace) -> TokenizerConfig:
    return TokenizerConfig(
        tokenizer_type=ns.tokenizer_type,
        vocab_file=ns.vocab_file,
        merge_file=ns.merge_file,
        tokenizer_model=ns.tokenizer_model,
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data", "mmap .bin/.idx datasets written by preprocess_data.py")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=[],
        help="PREFIX, or a blend W1 PREFIX1 W2 PREFIX2 ... (weights are normalized)",
    )
    g.add_argument(
        "--split",
        default="969,30,1",
        help="train,valid,test weights over the documents of --data-path (969,30,1)",
    )
    g.add_argument(
        "--train-data-path",
        nargs="*",
        default=[],
        help="separate train data (PREFIX or a blend); replaces --data-path/--split",
    )
    g.add_argument("--valid-data-path", nargs="*", default=[], help="separate validation data")
    g.add_argument("--test-data-path", nargs="*", default=[], help="separate test data")
    g.add_argument(
        "--data-cache-path",
        default=None,
        help="directory for the cached sample indices (default: beside the data)",
    )
    add_tokenizer_args(parser)


def world_size_from_env() -> int:
    """Processes in the job, as torchrun / deepspeed (WORLD_SIZE) or Slurm (SLURM_NTASKS) say."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def config_from_namespace(ns: argparse.Namespace, world_size: int) -> MegatronConfig:
    model = ModelConfig(
        num_layers=ns.num_layers,
        hidden_size=ns.hidden_size,
        ffn_hidden_size=ns.ffn_hidden_size,
        num_attention_heads=ns.num_attention_heads,
        num_query_groups=ns.num_query_groups,
        kv_channels=ns.kv_channels,
        seq_length=ns.seq_length,
        max_position_embeddings=ns.max_position_embeddings,
        vocab_size=ns.vocab_size,
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
        hidden_dropout=ns.hidden_dropout,
        attention_dropout=ns.attention_dropout,
        init_method_std=ns.init_method_std,
        position_embedding_type=ns.position_embedding_type,
        rotary_base=ns.rotary_base,
        normalization=ns.normalization,
        layernorm_epsilon=ns.layernorm_epsilon,
        swiglu=ns.swiglu,
        add_bias_linear=not ns.disable_bias_linear,
        untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights,
        recompute_granularity="full" if ns.checkpoint_activations else ns.recompute_granularity,
        recompute_method=ns.recompute_method,
        recompute_num_layers=ns.recompute_num_layers,
        attention_backend=ns.attention_backend,
        masked_softmax_fusion=ns.masked_softmax_fusion,
        layer_norm_fusion=ns.layer_norm_fusion,
        bias_gelu_fusion=ns.bias_gelu_fusion,
        bias_swiglu_fusion=ns.bias_swiglu_fusion,
        cross_entropy_loss_fusion=ns.cross_entropy_loss_fusion,
        torch_compile=ns.torch_compile,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=ns.tensor_model_parallel_size,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=ns.num_layers_per_virtual_pipeline_stage,
        world_size=world_size,
    )
    return MegatronConfig(
        model=model,
        parallel=parallel,
        distributed=DistributedConfig(
            backend=ns.distributed_backend,
            timeout_minutes=ns.distributed_timeout_minutes,
            local_rank=ns.local_rank,
            ddp_bucket_size=ns.ddp_bucket_size,
            overlap_grad_reduce=ns.overlap_grad_reduce,
        ),
        precision=PrecisionConfig(fp16=ns.fp16, bf16=ns.bf16),
        training=fill(
            TrainingConfig,
            ns,
            rampup_batch_size=tuple(ns.rampup_batch_size) if ns.rampup_batch_size else None,
        ),
        **training_run_groups(ns),
        data=DataConfig(
            data_path=tuple(ns.data_path),
            split=ns.split,
            train_data_path=tuple(ns.train_data_path),
            valid_data_path=tuple(ns.valid_data_path),
            test_data_path=tuple(ns.test_data_path),
            data_cache_path=ns.data_cache_path,
            tokenizer=tokenizer_config(ns),
        ),
    )


def parse_args(
    argv: Sequence[str] | None = None,
    world_size: int | None = None,
) -> MegatronConfig:
    """Parse argv (default sys.argv) into a validated, frozen config.

    `world_size` defaults to the launcher's environment, so the layout is checked before any
    process group exists.
    """
    ns = build_parser().parse_args(argv)
    cfg = config_from_namespace(ns, world_size if world_size is not None else world_size_from_env())
    validate(cfg)
    return cfg
