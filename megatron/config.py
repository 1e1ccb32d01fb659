"""The configuration tree: frozen dataclasses built once by `megatron.arguments`.

Library code receives these values (or single fields of them) as arguments; nothing reads argv
or a global. Every rule lives in `validate()`, which runs before any work and raises a
`ConfigError` naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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

    def resolved_global_batch_size(self, data_parallel_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * data_parallel_size


@dataclass(frozen=True)
class MegatronConfig:
    """The whole run configuration; one field per argument group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def replace(self, **groups) -> MegatronConfig:
        """A copy with whole groups swapped, e.g. cfg.replace(model=new_model_cfg)."""
        return dataclasses.replace(self, **groups)


def _fail(flag: str, problem: str, fix: str) -> None:
    raise ConfigError(f"{flag}: {problem}. Fix: {fix}.")


def validate_model(m: ModelConfig, tp: int = 1) -> None:
    """Shape rules of the model alone (and of its split over `tp` tensor-parallel ranks)."""
    for flag, value in (
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--seq-length", m.seq_length),
        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
    ):
        if value < 1:
            _fail(flag, f"must be a positive integer, got {value}", f"pass {flag} >= 1")
    if m.vocab_size is not None and m.vocab_size < 1:
        _fail("--vocab-size", f"must be positive, got {m.vocab_size}", "pass the tokenizer's size")
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
        if m.num_query_groups < 1 or m.num_attention_heads % m.num_query_groups:
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
    for flag, p in (
        ("--hidden-dropout", m.hidden_dropout),
        ("--attention-dropout", m.attention_dropout),
    ):
        if not 0.0 <= p < 1.0:
            _fail(
                flag,
                f"{p} is not a probability in [0, 1)",
                "pass a value such as 0.1 (0 disables it)",
            )
    if m.init_method_std <= 0:
        _fail("--init-method-std", f"must be positive, got {m.init_method_std}", "pass e.g. 0.02")
    if m.position_embedding_type not in ("learned", "rope"):
        _fail(
            "--position-embedding-type",
            f"unknown {m.position_embedding_type!r}",
            "use learned or rope",
        )
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        _fail("--normalization", f"unknown {m.normalization!r}", "use LayerNorm or RMSNorm")
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


def validate(cfg: MegatronConfig) -> None:
    """Every cross-group rule; raises ConfigError on the first broken one."""
    par, m = cfg.parallel, cfg.model
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    for flag, value in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
    ):
        if value < 1:
            _fail(flag, f"must be >= 1, got {value}", f"pass {flag} 1 or more")
    if par.world_size % (tp * pp):
        _fail(
            "--tensor-model-parallel-size/--pipeline-model-parallel-size",
            f"world size {par.world_size} is not divisible by TP x PP = {tp} x {pp}",
            "launch a multiple of TP x PP processes or change the parallel sizes",
        )
    validate_model(m, tp)
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
        if vlayers < 1 or (m.num_layers // pp) % vlayers:
            _fail(
                "--num-layers-per-virtual-pipeline-stage",
                f"{vlayers} does not divide the {m.num_layers // pp} layers of each pipeline stage",
                "choose a divisor of num-layers / pipeline-model-parallel-size",
            )
    if cfg.precision.fp16 and cfg.precision.bf16:
        _fail("--fp16/--bf16", "both are set", "choose one mixed-precision mode")
    if cfg.distributed.backend not in (None, "nccl", "gloo"):
        _fail("--distributed-backend", f"unknown {cfg.distributed.backend!r}", "use nccl or gloo")
    if cfg.distributed.timeout_minutes <= 0:
        _fail("--distributed-timeout-minutes", "must be positive", "pass e.g. 10")
    _validate_batch(cfg.training, par.data_parallel_size)
    _validate_data(cfg.data)


def _validate_data(d: DataConfig) -> None:
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


def parse_blend(paths: Sequence[str], flag: str = "--data-path") -> list[tuple[float, str]]:
    """`PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...` -> [(normalized weight, prefix)]."""
    if not paths:
        return []
    if len(paths) == 1:
        return [(1.0, paths[0])]
    if len(paths) % 2:
        _fail(
            flag,
            f"{len(paths)} values: a blend needs weight/prefix pairs",
            "write W1 PREFIX1 W2 PREFIX2 ... (or a single prefix)",
        )
    pairs = []
    for w, prefix in zip(paths[0::2], paths[1::2], strict=True):
        try:
            weight = float(w)
        except ValueError:
            _fail(flag, f"{w!r} is not a weight", "put a number before each prefix")
        if weight < 0:
            _fail(flag, f"negative weight {weight}", "use weights >= 0")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        _fail(flag, "the weights sum to 0", "give at least one dataset a positive weight")
    return [(w / total, p) for w, p in pairs]


def split_weights(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1', or fewer values) -> three normalized weights."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    values = [float(p) for p in parts]
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"{split!r} is not up to three non-negative weights with a positive sum")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def _validate_batch(t: TrainingConfig, dp: int) -> None:
    if t.micro_batch_size < 1:
        _fail("--micro-batch-size", f"must be >= 1, got {t.micro_batch_size}", "pass 1 or more")
    gbs = t.resolved_global_batch_size(dp)
    if gbs % (t.micro_batch_size * dp):
        _fail(
            "--global-batch-size",
            f"{gbs} is not divisible by --micro-batch-size {t.micro_batch_size} "
            f"x data-parallel size {dp}",
            f"use a multiple of {t.micro_batch_size * dp}",
        )
