"""The configuration tree: frozen dataclasses, one declaration per setting.

Each field is declared once, with `setting(default, help, *aliases, ...)`: the command line
(megatron.config.cli), config files (megatron.config.files) and `--print-config` are derived
from these declarations (megatron.config.declare). The section of a setting is the dataclass it
is in (`model.hidden_size` = `--hidden-size`). Library code receives these values (or single
fields of them) as arguments; nothing reads argv or a global. Every rule lives in
`megatron.config.rules`, which runs before any work and raises a `ConfigError` naming the flag.

Checkpoints record `ModelConfig` only (the architecture); the run-time switches that do not
change the weights (kernels, recompute) are sections of their own and are never saved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron.config.declare import ConfigError, Section, setting
from megatron.config.schema_compute import KernelConfig, RecomputeConfig
from megatron.config.schema_data import (
    TOKENIZER_TYPES,
    DataConfig,
    TokenizerConfig,
    parse_blend,
    split_weights,
)
from megatron.config.schema_mla import MLASettings
from megatron.config.schema_moe import MoESettings
from megatron.config.schema_run import (
    CheckpointConfig,
    DeepSpeedConfig,
    LoggingConfig,
    OptimizerConfig,
    TrainingConfig,
)

if TYPE_CHECKING:  # torch is imported lazily: the data tools start faster without it
    import torch

# The run, data and compute sections are declared in schema_run.py, schema_data.py and
# schema_compute.py (for size) and belong to this one tree.
__all__ = [
    "TOKENIZER_TYPES",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "DistributedConfig",
    "KernelConfig",
    "LoggingConfig",
    "MegatronConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RecomputeConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "model_config_from_saved",
    "parse_blend",
    "split_weights",
]


@dataclass(frozen=True)
class _DenseModelFields(Section):
    """The dense model's fields of ModelConfig (declared first, so they lead in --help)."""

    num_layers: int = setting(2, "transformer layers", min=1)
    hidden_size: int = setting(64, "model width h", min=1)
    num_attention_heads: int = setting(4, "query heads", min=1)
    ffn_hidden_size: int | None = setting(
        None, "MLP inner width (default 4h; with --swiglu 2/3 x 4h rounded down to 64)"
    )
    num_query_groups: int | None = setting(
        None, "key/value heads for grouped-query attention (default: one per query head)", min=1
    )
    kv_channels: int | None = setting(
        None, "size of each head (default hidden-size / num-attention-heads)"
    )
    seq_length: int = setting(128, "tokens per sample", min=1)
    max_position_embeddings: int | None = setting(
        None, "rows of the learned position table (default: seq-length)"
    )
    vocab_size: int | None = setting(
        None, "vocabulary size when no tokenizer sets it (e.g. the null tokenizer)", min=1
    )
    make_vocab_size_divisible_by: int = setting(
        128, "pad the vocab to a multiple of this x TP size; padding is masked out", min=1
    )
    hidden_dropout: float = setting(0.1, "dropout on residual branches", min=0, below=1)
    attention_dropout: float = setting(0.1, "dropout on attention probs", min=0, below=1)
    init_method_std: float = setting(
        0.02, "std of the normal init (output projections get std / sqrt(2 x num-layers))", above=0
    )
    position_embedding_type: str = setting(
        "learned",
        "learned absolute positions (GPT-2) or rotary embeddings",
        choices=("learned", "rope"),
    )
    rotary_base: float = setting(10000.0, "RoPE base")
    normalization: str = setting(
        "LayerNorm", "normalization layer", choices=("LayerNorm", "RMSNorm")
    )
    layernorm_epsilon: float = setting(1e-5, "norm epsilon")
    swiglu: bool = setting(False, "SwiGLU MLP instead of GeLU")
    add_bias_linear: bool = setting(
        True, "no bias in the linear layers", flag="--disable-bias-linear"
    )
    untie_embeddings_and_output_weights: bool = setting(
        False, "separate output head instead of reusing the input embedding"
    )
    # The Megatron-LM v1.x architecture options (its GPT-2 scripts run unchanged).
    apply_query_key_layer_scaling: bool = setting(
        False,
        "v1.x fp16 overflow guard: q k^T is divided by the layer number L inside the GEMM and "
        "multiplied back in the fp32 softmax (same result in exact math); under fp16/bf16 the "
        "attention then takes the matmul + fp32-softmax path",
    )
    openai_gelu: bool = setting(
        False, "tanh-approximate GeLU (OpenAI GPT-2's, HF gelu_new) instead of the exact erf GeLU"
    )
    apply_residual_connection_post_layernorm: bool = setting(
        False, "residuals start from the normed input (original BERT order), not from x"
    )
    num_unique_layers: int | None = setting(
        None,
        "share weights: only this many distinct layers, reused to make --num-layers "
        "(must divide it; default: no sharing)",
        min=1,
    )
    param_sharing_style: str = setting(
        "grouped",
        "order of the shared layers, e.g. 4 layers of 2 unique: grouped [1, 2, 1, 2], "
        "spaced [1, 1, 2, 2] (PP > 1 needs each unique layer on one stage: spaced)",
        choices=("grouped", "spaced"),
    )

    mtp_num_layers: int | None = setting(
        None,
        "multi-token prediction depth D (DeepSeek-V3): D sequential modules on the last stage, "
        "module k predicting the token k + 1 places ahead through the shared embedding and "
        "output head; their mean loss is added with --mtp-loss-scaling-factor (default: none)",
        min=1,
    )
    mtp_loss_scaling_factor: float = setting(
        0.1,
        "weight of the multi-token prediction loss: the LM loss + factor / D x the sum of the "
        "D depths' losses",
        min=0,
    )

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Keeps SwiGLU's parameter count near the 4h GeLU MLP (as Megatron does).
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    def unique_layer(self, i: int) -> int:
        """Which of the --num-unique-layers distinct layers layer i (0-based) runs."""
        n = self.num_unique_layers or self.num_layers
        if self.param_sharing_style == "spaced":
            return i // (self.num_layers // n)
        return i % n

    def layer_owner(self, i: int) -> int:
        """The layer whose name (`layers.<owner>.`) holds layer i's weights: the first layer
        that runs the same unique layer (i itself without sharing)."""
        u = self.unique_layer(i)
        n = self.num_unique_layers or self.num_layers
        return u * (self.num_layers // n) if self.param_sharing_style == "spaced" else u

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
class ModelConfig(MLASettings, MoESettings, _DenseModelFields):
    """Shape and architecture of the GPT (defaults are GPT-2's); saved in checkpoints. The
    mixture-of-experts fields (--num-experts, ...) follow, declared in
    megatron.config.schema_moe, then multi-latent attention's (megatron.config.schema_mla)."""


def model_config_from_saved(saved: dict) -> ModelConfig:
    """The ModelConfig of a checkpoint's args["model"]. Keys that are not (or no longer)
    ModelConfig fields are dropped: checkpoints from before the run-time switches moved out
    (fusions, recompute, ...) hold them, and newer code may add others."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in names})


LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),  # torchrun, deepspeed, torch.distributed.launch
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # OpenMPI
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH, Intel MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH
)


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How the ranks are split: TP fastest, then CP, then DP, then PP."""

    tensor_model_parallel_size: int = setting(
        1, "tensor-parallel ranks per layer", "--model-parallel-size", min=1
    )
    pipeline_model_parallel_size: int = setting(
        1,
        "pipeline stages (v1.x --pipe-parallel-size 0, no pipeline, means 1)",
        "--pipe-parallel-size",
        min=1,
    )
    context_parallel_size: int = setting(
        1,
        "context-parallel ranks per sequence (CP): each sample's sequence is cut into 2 x CP "
        "chunks, CP rank r holding chunks r and 2 CP - 1 - r, and attention passes keys and "
        "values round the CP group (ring attention); needs --seq-length divisible by 2 x CP",
        min=1,
    )
    expert_model_parallel_size: int = setting(
        1,
        "expert-parallel ranks (EP), carved from the data-parallel x context-parallel ones: "
        "each holds E / EP experts of every MoE layer and tokens go to them by all-to-all; "
        "expert gradients are averaged over the DP x CP / EP ranks holding the same experts",
        min=1,
    )
    expert_tensor_parallel_size: int | None = setting(
        None,
        "expert-tensor-parallel ranks (ETP): 1 replicates every expert over the TP group, the "
        "TP size splits each expert's FFN over it as the dense MLP is (fc1 column-, fc2 "
        "row-parallel; with --sequence-parallel the TP group's tokens are gathered for the "
        "experts and their outputs scattered back); no other size (default: the TP size, as "
        "in Megatron-core; 1 with --deepspeed, as in Megatron-DeepSpeed)",
        min=1,
    )
    moe_token_dispatcher_type: str = setting(
        "alltoall",
        "how tokens reach their experts' EP rank: alltoall (each token sent where it goes), or "
        "allgather (every token gathered on every EP rank, outputs reduce-scattered back)",
        choices=("alltoall", "allgather"),
    )
    num_layers_per_virtual_pipeline_stage: int | None = setting(
        None, "layers per model chunk for the interleaved pipeline schedule", min=1
    )
    pipeline_schedule: str | None = setting(
        None,
        "the pipeline-parallel schedule (megatron/pipeline_order.py): 1f1b; interleaved (model "
        "chunks of --num-layers-per-virtual-pipeline-stage layers); zb-h1 (zero bubble: 1F1B "
        "with each backward split into the input gradient and a later weight gradient that "
        "fills the bubble, at 1F1B's activation memory); zbv (two chunks per stage placed "
        "in a V, stage 0 holding the first and the last layers, zero bubble at about 1F1B's "
        "memory) and dualpipev (DeepSeek-V3's order on the same V). Default: interleaved when "
        "--num-layers-per-virtual-pipeline-stage is given, else 1f1b",
        choices=("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"),
    )
    overlap_moe_expert_parallel_comm: bool | None = setting(
        None,
        "hide the MoE token all-to-alls (EP > 1, alltoall dispatcher) behind compute: "
        "--pipeline-schedule dualpipev runs each steady-state pair, the forward of one micro "
        "batch and the backward of another, in two threads that take turns at the "
        "all-to-alls, so one's tokens travel while the other computes (the same numbers as "
        "running them one after the other). Default: on wherever dualpipev has EP all-to-alls "
        "(what DualPipeV is; torchtitan's pipeline_parallel_expert_parallel_overlap)",
        shortcuts={
            "--no-overlap-moe-expert-parallel-comm": (
                False,
                "run dualpipev's forward / backward pairs one after the other",
            )
        },
    )
    sequence_parallel: bool = setting(
        False,
        "split the activations outside the tensor-parallel regions (norms, dropout, residuals) "
        "along the sequence over the TP group, s / TP tokens per rank (needs TP > 1 and a "
        "sequence length divisible by TP)",
    )
    auto_parallel: bool = setting(
        False,
        "choose TP, PP, virtual stages, --sequence-parallel, the micro batch and recompute for "
        "the launched world size with the planner (tools/plan_parallel.py): the fastest layout "
        "predicted to fit; those of them given away from their defaults stay as given; the "
        "resolved run config records the choice (with auto_parallel off)",
    )
    auto_parallel_gpu_memory_gb: float | None = setting(
        None,
        "GiB per GPU for --auto-parallel (default: the first CUDA device's total memory)",
        above=0,
    )
    auto_parallel_gpus_per_node: int = setting(
        8,
        "GPUs per node for --auto-parallel (TP within a node, DP / PP traffic across nodes)",
        min=1,
    )
    auto_parallel_overhead_gb: float = setting(
        1.0,
        "GiB per GPU the planner reserves for the framework (CUDA context, allocator cache)",
        min=0,
    )
    fault_tolerance: bool = setting(
        False,
        "torchft's per-step fault tolerance of data-parallel replica groups: each replica "
        "group (TP ranks, launched as a job of its own) averages its gradients with the "
        "replicas alive at that step, a dead one is dropped without a restart, a restarted one "
        "fetches the weights and optimizer state from a live peer (docs/operations.md)",
    )
    ft_replica_id: int = setting(
        0, "--fault-tolerance: this replica group's index, 0 to --ft-group-size - 1", min=0
    )
    ft_group_size: int = setting(
        1,
        "--fault-tolerance: the replica groups at full strength; the data-parallel size of "
        "--global-batch-size (each group reads its 1 / N share of it)",
        min=1,
    )
    ft_min_replica_size: int = setting(
        1, "--fault-tolerance: a step commits only with at least this many replica groups", min=1
    )
    ft_lighthouse: str | None = setting(
        None,
        "--fault-tolerance: the torchft lighthouse's address, e.g. http://HOST:29510 "
        "(default: $TORCHFT_LIGHTHOUSE); start it with `torchft_lighthouse --min_replicas 1`",
    )
    ft_max_retries: int = setting(
        3,
        "--fault-tolerance: steps in a row that may fail to commit (a replica group raised or "
        "died) before the run stops",
        min=0,
    )
    ft_timeout_seconds: float = setting(
        60.0,
        "--fault-tolerance: how long a cross-replica all-reduce, a commit or a recovery from a "
        "peer may take before the step is given up and redone (a quorum waits at least 60 s)",
        above=0,
    )
    world_size: int = setting(
        1,
        "processes in the job, set by the launcher (WORLD_SIZE or SLURM_NTASKS)",
        from_env=True,
        min=1,
    )

    @property
    def data_parallel_size(self) -> int:
        """DP ranks of the job; with --fault-tolerance the replica groups at full strength."""
        groups = self.ft_group_size if self.fault_tolerance else 1
        return (
            groups
            * self.world_size
            // (
                self.tensor_model_parallel_size
                * self.context_parallel_size
                * self.pipeline_model_parallel_size
            )
        )

    @property
    def expert_tp_size(self) -> int:
        """--expert-tensor-parallel-size, or the TP size when not given."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def resolved_pipeline_schedule(self) -> str:
        """--pipeline-schedule, or the one the other flags imply."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "1f1b" if self.num_layers_per_virtual_pipeline_stage is None else "interleaved"

    def virtual_pipeline_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline rank for the interleaved schedule (None: not interleaved)."""
        if self.pipeline_schedule in ("zbv", "dualpipev"):
            return 2  # the two legs of the V
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        per_stage = num_layers // self.pipeline_model_parallel_size
        return per_stage // self.num_layers_per_virtual_pipeline_stage


@dataclass(frozen=True)
class DistributedConfig(Section):
    """Process groups and data-parallel gradient reduction."""

    backend: str | None = setting(
        None,
        "collective backend (default nccl on CUDA, gloo on CPU)",
        flag="--distributed-backend",
        choices=("nccl", "gloo"),
    )
    timeout_minutes: float = setting(
        10.0,
        "a collective that waits longer fails the job",
        flag="--distributed-timeout-minutes",
        above=0,
    )
    local_rank: int | None = setting(
        None, "set by some launchers; LOCAL_RANK from the environment wins", "--local_rank"
    )
    ddp_bucket_size: int = setting(
        40_000_000, "gradient elements per data-parallel all-reduce bucket"
    )
    overlap_grad_reduce: bool = setting(
        True, "all-reduce gradients after backward instead of during it"
    )
    ddp_impl: str = setting(
        "local",
        "data parallelism: local = our fp32 gradient buckets; torch = "
        "torch.nn.parallel.DistributedDataParallel (PP = 1, fp32 weights)",
        "--DDP-impl",
        choices=("local", "torch"),
    )
    allreduce_dtype: str = setting(
        "fp32",
        "dtype of the data-parallel gradient all-reduce: fp32, or params = the fp16/bf16 "
        "weights' dtype (half the traffic; gradients still accumulate in fp32)",
        choices=("fp32", "params"),
        shortcuts={"--fp32-allreduce": ("fp32", "classic flag: --allreduce-dtype fp32")},
    )
    use_cpu_initialization: bool = setting(
        False, "build the model on the CPU, then move it to the device (the same weights)"
    )
    use_torch_fsdp2: bool = setting(
        False,
        "shard weights, gradients and optimizer state over the data-parallel (x context-"
        "parallel) ranks with torch's FSDP2 (torch.distributed.fsdp.fully_shard, per "
        "transformer layer): weights all-gathered before each layer runs, gradients "
        "reduce-scattered (ZeRO-3); replaces our DDP buckets",
    )
    torch_fsdp2_reshard_after_forward: str = setting(
        "auto",
        "with --use-torch-fsdp2: free each unit's gathered weights after its forward and gather "
        "them again for backward (true, ZeRO-3), keep them until backward (false: one "
        "all-gather per step fewer, ZeRO-2's memory for the weights), or auto: true for the "
        "layers, false for each model chunk's root unit (FSDP2's reshard_after_forward=None)",
        choices=("auto", "true", "false"),
        shortcuts={
            "--torch-fsdp2-no-reshard-after-forward": (
                "false",
                "Megatron-core's spelling of --torch-fsdp2-reshard-after-forward false",
            )
        },
    )


@dataclass(frozen=True)
class PrecisionConfig(Section):
    """Mixed precision."""

    fp16: bool = setting(False, "fp16 weights/activations, loss scaling")
    bf16: bool = setting(False, "bf16 weights/activations")
    fp8_format: str | None = setting(
        None,
        "float8 GEMMs in the transformer layers' linears (torchao's float8 training; needs "
        "--bf16, a GPU of compute capability 8.9+ and torchao): e4m3 = every operand e4m3; "
        "hybrid = e4m3 forward, e5m2 gradients (more range, less precision); embeddings, "
        "output head, norms, attention and the weights stay bf16 (default: off, all bf16)",
        choices=("e4m3", "hybrid"),
    )
    fp8_recipe: str | None = setting(
        None,
        "float8 scaling with --fp8-format, recomputed from each tensor at every step: "
        "tensorwise = one scale per tensor (fastest); rowwise = one per row, power-of-two "
        "scales (more accurate). Megatron-core's delayed, mxfp8 and blockwise (Transformer "
        "Engine recipes) are refused (default: tensorwise)",
        choices=("tensorwise", "rowwise", "delayed", "mxfp8", "blockwise"),
    )

    @property
    def fp8_scaling(self) -> str:
        """--fp8-recipe, or its default (tensorwise)."""
        return self.fp8_recipe or "tensorwise"

    @property
    def params_dtype(self) -> torch.dtype:
        import torch

        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32


@dataclass(frozen=True)
class BertConfig(Section):
    """BERT pretraining (pretrain_bert.py); pretrain_gpt2.py refuses them when changed."""

    mask_prob: float = setting(
        0.15, "fraction of each sample's tokens the MLM predicts", above=0, below=1
    )
    short_seq_prob: float = setting(
        0.1, "probability that a sample is cut to a random shorter length", min=0, max=1
    )
    bert_no_binary_head: bool = setting(
        False, "no pooler and next-sentence (NSP) head: MLM only, one segment per sample"
    )
    whole_word_masking: bool = setting(
        False, "choose a word's '##' WordPiece pieces together for masking"
    )

    @property
    def changed(self) -> list[str]:
        """The flags set away from their defaults."""
        default = BertConfig()
        return [
            "--" + f.name.replace("_", "-")
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]


@dataclass(frozen=True)
class MegatronConfig(Section):
    """The whole run configuration; one field per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    bert: BertConfig = field(default_factory=BertConfig)

    def replace(self, **groups) -> MegatronConfig:
        """A copy with whole groups swapped, e.g. cfg.replace(model=new_model_cfg)."""
        return dataclasses.replace(self, **groups)
