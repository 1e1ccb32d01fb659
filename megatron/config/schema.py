"""The configuration tree: frozen dataclasses built once by `megatron.config.cli`.

Library code receives these values (or single fields of them) as arguments; nothing reads argv
or a global. Every rule lives in `megatron.config.rules.validate()`, which runs before any work
and raises a `ConfigError` naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: the data tools start faster without it
    import torch


class ConfigError(ValueError):
    """A flag combination that cannot work; the message names the flag and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and architecture of the GPT (GPT-2 defaults)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = (
        None  # None: 4h (GeLU) or Megatron's 2/3 * 4h rounded to 64 (SwiGLU)
    )
    num_query_groups: int | None = None  # None: one per head (plain multi-head attention)
    kv_channels: int | None = None  # None: hidden_size / num_attention_heads
    seq_length: int = 128
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int | None = (
        None  # real tokenizer vocab; None until a tokenizer or --vocab-size sets it
    )
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    position_embedding_type: str = "learned"  # learned | rope
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    recompute_granularity: str | None = None  # None | full | selective
    recompute_method: str = "uniform"  # uniform | block (with full)
    recompute_num_layers: int = 1
    attention_backend: str = "sdpa"  # sdpa | fused (Triton softmax) | unfused (torch eager)
    masked_softmax_fusion: bool = True
    layer_norm_fusion: bool = True  # residual add + LayerNorm/RMSNorm in one kernel
    bias_gelu_fusion: bool = True
    bias_swiglu_fusion: bool = True
    cross_entropy_loss_fusion: bool = False
    torch_compile: bool = False  # compile each transformer layer instead of (or with) kernels

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Keeps SwiGLU's parameter count near the 4h GeLU MLP (as Megatron does).
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Vocab rounded up to a multiple of make-vocab-size-divisible-by x TP.

        Every TP rank then owns an equal, aligned slice of the embedding; the padding rows are
        excluded from the softmax, so padding never changes the loss.
        """
        if self.vocab_size is None:
            raise ConfigError("the vocabulary size is unknown: pass --vocab-size or a tokenizer")
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks are split: TP fastest, then DP, then PP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    world_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    def virtual_pipeline_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline rank for the interleaved schedule (None: not interleaved)."""
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        per_stage = num_layers // self.pipeline_model_parallel_size
        return per_stage // self.num_layers_per_virtual_pipeline_stage


@dataclass(frozen=True)
class DistributedConfig:
    backend: str | None = None  # None: nccl on CUDA, gloo otherwise
    timeout_minutes: float = 10.0
    local_rank: int | None = None
    ddp_bucket_size: int = 40_000_000  # gradient elements per all-reduce bucket
    overlap_grad_reduce: bool = True  # all-reduce buckets during backward


@dataclass(frozen=True)
class PrecisionConfig:
    fp16: bool = False
    bf16: bool = False

    @property
    def params_dtype(self) -> torch.dtype:
        import torch

        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32


@dataclass(frozen=True)
class TokenizerConfig:
    tokenizer_type: str | None = None  # None: ids come pre-tokenized (--vocab-size sets the vocab)
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None

    def kwargs(self) -> dict:
        """Keyword arguments of megatron.data.tokenizers.build_tokenizer."""
        return {
            "vocab_file": self.vocab_file,
            "merge_file": self.merge_file,
            "tokenizer_model": self.tokenizer_model,
        }


@dataclass(frozen=True)
class DataConfig:
    """Where the mmap datasets are and how they are split and blended (Megatron's flags)."""

    data_path: tuple[str, ...] = ()  # PREFIX, or W1 PREFIX1 W2 PREFIX2 ...
    split: str = "969,30,1"
    train_data_path: tuple[str, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    test_data_path: tuple[str, ...] = ()
    data_cache_path: str | None = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass(frozen=True)
class TrainingConfig:
    seed: int = 1234
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size x data-parallel size
    rampup_batch_size: tuple[int, int, int] | None = None  # start, increment, ramp samples
    train_iters: int | None = None
    train_samples: int | None = None
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    clip_grad: float = 1.0
    max_skipped_in_a_row: int = 50  # consecutive overflow/NaN skips before the run stops
    num_workers: int = 2  # DataLoader worker processes

    def resolved_global_batch_size(self, data_parallel_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * data_parallel_size


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, learning-rate schedule and loss scaling (Megatron's flag names)."""

    optimizer: str = "adam"  # adam (decoupled weight decay, i.e. AdamW) | sgd
    lr: float | None = None
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None
    warmup: float | None = None  # classic Megatron spelling of the warmup fraction
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    override_lr_scheduler: bool = False
    use_checkpoint_lr_scheduler: bool = False
    loss_scale: float | None = None  # fp16: static scale; None: dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # load weights only; start at iteration 0
    save_retain_last: int | None = None


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    timing_log_level: int = 0  # 0: iteration time only; 1: + forward/backward/optimizer; 2: all
    peak_tflops: float | None = None  # per device, for MFU; default from the device when known


@dataclass(frozen=True)
class DeepSpeedConfig:
    """--deepspeed and the classic Megatron-DeepSpeed flags (None: not given, the JSON decides)."""

    enabled: bool = False
    config: str | None = None  # --deepspeed_config JSON
    zero_stage: int | None = None
    zero_reduce_scatter: bool | None = None
    zero_contigious_gradients: bool | None = None
    zero_reduce_bucket_size: int | None = None
    zero_allgather_bucket_size: int | None = None
    cpu_optimizer: bool = False  # offload optimizer states to CPU (ZeRO >= 1)
    partition_activations: bool = False
    checkpoint_in_cpu: bool = False
    contigious_checkpointing: bool = False
    synchronize_each_layer: bool = False
    profile_backward: bool = False


@dataclass(frozen=True)
class MegatronConfig:
    """The whole run configuration; one field per argument group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    def replace(self, **groups) -> MegatronConfig:
        """A copy with whole groups swapped, e.g. cfg.replace(model=new_model_cfg)."""
        return dataclasses.replace(self, **groups)
