"""Rules of the compute section (megatron.config.schema_kernels): the v1.x kernel precision
flags, --torch-compile and its backend, --enable-cuda-graph and --sdpa-backend. Whether the
device runs them is checked where the model is built (a CUDA device for CUDA graphs, a
kernel SDPA can run)."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.rules_pairs import refuse_pairs
from megatron.config.schema import MegatronConfig


def validate_compute(cfg: MegatronConfig) -> None:
    _validate_v1_kernels(cfg)
    k = cfg.kernels
    if k.torch_compile_backend != "inductor" and not k.torch_compile:
        fail(
            "--torch-compile-backend",
            f"{k.torch_compile_backend} given without --torch-compile",
            "add --torch-compile or drop the flag",
        )
    if k.sdpa_backend != "auto":
        _validate_sdpa_backend(cfg)
    if k.enable_cuda_graph:
        _validate_cuda_graph(cfg)


def _validate_v1_kernels(cfg: MegatronConfig) -> None:
    k = cfg.kernels
    if k.fp16_lm_cross_entropy and not (cfg.precision.fp16 or cfg.precision.bf16):
        fail(
            "--fp16-lm-cross-entropy",
            "given without --fp16/--bf16: the logits are fp32 already",
            "add --fp16 (as Megatron-LM v1.x required) or drop the flag",
        )


def _validate_sdpa_backend(cfg: MegatronConfig) -> None:
    k = cfg.kernels
    if k.attention_backend != "sdpa":
        fail(
            "--sdpa-backend",
            f"{k.sdpa_backend} picks the kernel of --attention-backend sdpa, not of "
            f"{k.attention_backend}",
            "use --attention-backend sdpa or drop --sdpa-backend",
        )
    refuse_pairs(cfg, "--sdpa-backend")  # megatron.config.rules_pairs


def _cuda_graph_conflicts(cfg: MegatronConfig) -> list[tuple[bool, str]]:
    """(conflict?, why) for every setting CUDA graph replay cannot take."""
    par, m = cfg.parallel, cfg.model
    return [
        (not cfg.kernels.torch_compile, "replays the compiled chunks: add --torch-compile"),
        (
            cfg.kernels.torch_compile_backend != "inductor",
            "captures the kernels Inductor generates: use --torch-compile-backend inductor",
        ),
        (
            cfg.deepspeed.enabled,
            "is for our own trainer (DeepSpeed's engine runs the step): drop --deepspeed",
        ),
        (
            par.pipeline_model_parallel_size > 1,
            "replays one whole chunk per micro batch; the pipeline schedules interleave stages' "
            "sends and receives between them: use --pipeline-model-parallel-size 1",
        ),
        (
            par.tensor_model_parallel_size > 1 or par.context_parallel_size > 1,
            "runs with TP = CP = 1 only, as the tensor- and context-parallel collectives "
            "inside the forward would split the graphs: use --tensor-model-parallel-size 1 "
            "--context-parallel-size 1, or drop --enable-cuda-graph",
        ),
        (
            m.moe,
            "cannot replay MoE routing, whose shapes (tokens per expert) change every step: "
            "drop --num-experts",
        ),
        (
            m.hidden_dropout > 0 or m.attention_dropout > 0,
            "would replay the dropout RNG streams of the capture: use --hidden-dropout 0 "
            "--attention-dropout 0",
        ),
        (
            cfg.optimizer.overlap_param_gather,
            "would be cut into one graph per module by --overlap-param-gather's waits: drop "
            "--overlap-param-gather",
        ),
        (
            cfg.recompute.granularity is not None,
            "replays the forward and backward as captured; activation recompute runs the "
            "forward again inside the backward: drop --recompute-granularity",
        ),
    ]


def _validate_cuda_graph(cfg: MegatronConfig) -> None:
    for conflict, why in _cuda_graph_conflicts(cfg):
        if conflict:
            problem, fix = why.rsplit(": ", 1)  # every entry ends in ": <the fix>"
            fail("--enable-cuda-graph", problem, fix)
