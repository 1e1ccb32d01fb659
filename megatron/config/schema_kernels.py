"""The kernels section of the config tree (`kernels.*`): fused kernels, attention backends and
compilation. Run-time switches that change no weight, so never saved in checkpoints. Part of
megatron.config.schema (import them from here); declared the same way, with
`setting(default, help, *aliases, ...)`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


@dataclass(frozen=True)
class KernelConfig(Section):
    """Fused kernels and compilation (Triton on CUDA, torch elsewhere); not saved in checkpoints."""

    attention_backend: str = setting(
        "sdpa",
        "sdpa: torch scaled_dot_product_attention (flash where available); "
        "fused: matmul + Triton scaled causal softmax; unfused: plain torch. With "
        "--context-parallel-size > 1, ring attention's blocks: sdpa runs SDPA's fused kernels "
        "that return the log-sum-exp (flash / memory-efficient on CUDA, flash on CPU; "
        "explicit fp32 math where the device or dtype has none, or for attention dropout on "
        "CPU), unfused the explicit fp32 math; fused is refused",
        choices=("sdpa", "fused", "unfused"),
    )
    masked_softmax_fusion: bool = setting(
        True,
        "torch softmax in the fused backend",
        shortcuts={
            flag: (
                True,
                f"v1.x spelling of the default: Triton {what} softmax with "
                "--attention-backend fused (sdpa fuses the whole attention already)",
            )
            for flag, what in (
                ("--scaled-upper-triang-masked-softmax-fusion", "scaled causal"),
                ("--scaled-masked-softmax-fusion", "scaled masked"),
            )
        },
    )
    layer_norm_fusion: bool = setting(
        True, "separate residual add and norm", "--no-persist-layer-norm"
    )
    bias_gelu_fusion: bool = setting(
        True,
        "separate bias add and GeLU",
        shortcuts={
            "--bias-gelu-fusion": (
                True,
                "v1.x spelling of the default: Triton bias + GeLU where it runs "
                "(erf or, with --openai-gelu, tanh form)",
            )
        },
    )
    bias_dropout_fusion: bool = setting(
        False,
        "each block's output bias + dropout + residual add as one torch.compile'd function "
        "(Megatron's fused bias_dropout_add; needs a C++ compiler on CPU, Triton on CUDA)",
        shortcuts={
            "--no-bias-dropout-fusion": (
                False,
                "Megatron-LM 2.x+ spelling of the default here: separate torch ops",
            )
        },
    )
    bias_swiglu_fusion: bool = setting(True, "torch SwiGLU")
    kernel_library: str = setting(
        "ours",
        "whose Triton kernels run the fused ops: ours (megatron/fused_kernels), or liger "
        "(Liger-Kernel's residual add + RMSNorm, LayerNorm after a torch residual add, and "
        "SwiGLU; needs pip install liger-kernel; bias + GeLU, softmax and cross-entropy stay "
        "ours). An op Liger's kernel fails its start-up check on falls back to ours, with a "
        "warning; the --no-*-fusion flags still pick torch",
        choices=("ours", "liger"),
    )
    cross_entropy_loss_fusion: bool = setting(
        True,
        "torch vocab-parallel cross-entropy (fp32 logits); default: the Triton kernel without "
        "fp32 logits where it runs and passes its check (CUDA, or TRITON_INTERPRET=1), torch "
        "elsewhere and with --fp16-lm-cross-entropy; the choice is logged",
        shortcuts={
            "--cross-entropy-loss-fusion": (
                True,
                "Megatron-core spelling of the default: the Triton cross-entropy where it runs",
            )
        },
    )
    torch_compile: bool = setting(
        False,
        "torch.compile each model chunk's forward as one module: embedding, transformer layers, "
        "head and vocab-parallel loss, TP collectives included (graph breaks only where Dynamo "
        "cannot trace: dropout's RNG-tracker forks, MoE routing, --overlap-param-gather's "
        "waits); the norms and activations "
        "then run as torch ops Inductor fuses, the Triton cross-entropy between the graphs",
    )
    torch_compile_backend: str = setting(
        "inductor",
        "backend of --torch-compile: inductor (generated kernels), or aot_eager / eager "
        "(trace only, no code generation: fast, for tests and debugging)",
        choices=("inductor", "aot_eager", "eager"),
    )
    enable_cuda_graph: bool = setting(
        False,
        "replay each compiled chunk's forward and backward as CUDA graphs (torch.compile "
        "mode='reduce-overhead', CUDA graph trees): removes the per-kernel launch cost of small "
        "models. Needs --torch-compile with the inductor backend, a CUDA device, one pipeline "
        "stage, TP = CP = 1, no MoE, no dropout, no activation recompute, no --deepspeed, no "
        "--overlap-param-gather",
    )
    sdpa_backend: str = setting(
        "auto",
        "the kernel of --attention-backend sdpa: cudnn, flash, efficient or math (refused at "
        "model build where it cannot run the model's attention); auto: the first of cudnn, "
        "flash, efficient, math that can (torch's default order where it cannot be set). The "
        "choice is logged",
        choices=("auto", "cudnn", "flash", "efficient", "math"),
    )
    cross_entropy_fusion_impl: str = setting(
        "native",
        "native: the output layer's logits (tokens x vocab / TP), then the cross-entropy; "
        "linear: the output layer and the vocab-parallel cross-entropy fused over chunks of "
        "tokens (about 512 MiB of fp32 logits each), so the whole logits and their fp32 copy "
        "never exist (the chunk's logits are computed again in backward: one more output-layer "
        "matmul). With --cross-entropy-loss-fusion the chunks' elementwise part runs in its "
        "Triton kernels. Megatron-core's flag of the same name (its te impl is not offered)",
        choices=("native", "linear"),
    )
    moe_grouped_gemm: bool = setting(
        False,
        "MoE: each layer's experts as one grouped matmul (torch._grouped_mm where it runs, else "
        "a batched matmul over the groups padded to the largest); default: a loop over experts",
    )
    attention_softmax_in_fp32: bool = setting(
        False,
        "with fp16/bf16, attention probabilities from an fp32 softmax for every backend "
        "(sdpa then takes the matmul + fp32-softmax path; fused/unfused always do)",
    )
    fp16_lm_cross_entropy: bool = setting(
        False,
        "v1.x: the loss from the fp16/bf16 logits in their own dtype (saves the fp32 copy of "
        "the logits); default: computed in fp32",
    )
    onnx_safe: str | None = setting(
        None,
        "v1.x: use ONNX-exportable ops (took a value, e.g. --onnx-safe true). Accepted; "
        "changes nothing here: the model's ops (exact GeLU as torch gelu, SDPA) export as they are",
        metavar="BOOL",
    )
