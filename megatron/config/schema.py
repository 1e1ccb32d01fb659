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
from megatron.config.schema_checkpoint import CheckpointConfig
from megatron.config.schema_data import DataConfig
from megatron.config.schema_deepspeed import DeepSpeedConfig
from megatron.config.schema_distributed import DistributedConfig
from megatron.config.schema_kernels import KernelConfig
from megatron.config.schema_logging import LoggingConfig
from megatron.config.schema_model_mla import MLASettings
from megatron.config.schema_model_moe import MoESettings
from megatron.config.schema_model_window import WindowSettings
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.config.schema_parallel import ParallelConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.config.schema_training import TrainingConfig

if TYPE_CHECKING:  # torch is imported lazily: the data tools start faster without it
    import torch

# Every other section is declared in its own file, schema_<section>.py (the model section's MoE
# and MLA fields in schema_model_moe.py and schema_model_mla.py), and belongs to this one tree;
# a section is imported from its own file (ConfigError from config.declare), not from here.
__all__ = ["MegatronConfig", "ModelConfig", "PrecisionConfig", "model_config_from_saved"]


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
class ModelConfig(WindowSettings, MLASettings, MoESettings, _DenseModelFields):
    """Shape and architecture of the GPT (defaults are GPT-2's); saved in checkpoints. The
    mixture-of-experts fields (--num-experts, ...) follow, declared in
    megatron.config.schema_model_moe, then multi-latent attention's
    (megatron.config.schema_model_mla), then the windows' and sinks'
    (megatron.config.schema_model_window)."""


def model_config_from_saved(saved: dict) -> ModelConfig:
    """The ModelConfig of a checkpoint's args["model"]. Keys that are not (or no longer)
    ModelConfig fields are dropped: checkpoints from before the run-time switches moved out
    (fusions, recompute, ...) hold them, and newer code may add others."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in names})


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
