"""Megatron-style log lines, model FLOPs for throughput/MFU, and the metrics sinks (TensorBoard,
Weights & Biases) that receive the same scalars."""

from __future__ import annotations

import math
import resource
import textwrap

import torch

from megatron.config.rules_pipeline import overlaps_moe_pairs
from megatron.config.schema import ModelConfig
from megatron.config.schema_logging import LoggingConfig
from megatron.planning import mla

# Dense bf16/fp16 tensor-core peak of one device, TFLOP/s (for MFU when --peak-tflops is unset).
KNOWN_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10": 125.0,
    "L40": 181.0,
    "V100": 125.0,
}


def model_flops_per_sample(m: ModelConfig, seq: int, recompute: bool = False) -> float:
    """Matmul FLOPs to train on one sample: 3x the forward (4x with full recompute).

    Per layer forward: QKV 2sh(h + 2 g d), scores and weighted sum 2 x 2s^2 h, output 2sh^2,
    MLP 2sh f x (3 with SwiGLU, else 2); plus the logits 2shV. An MoE layer (--num-experts)
    counts its active parameters: the router 2shE, k experts of width f_e and the shared one.
    Multi-latent attention: megatron.planning.mla.attention_flops. Each --mtp-num-layers
    depth: a layer of the last layer's kind, eh_proj 2s(2h)h, the logits. A windowed layer
    (--window-size) scores each query against its window's LEFT + 1 keys, not s.
    """
    h, d = m.hidden_size, m.head_dim
    attn_out = m.num_attention_heads * d

    def attention(keys: int) -> int:
        if m.multi_latent_attention:  # latents, up projections, scores over d_qk, values d_v
            return mla.attention_flops(m, seq, keys)
        return (
            2 * seq * h * (attn_out + 2 * m.query_groups * d)
            + 4 * seq * keys * attn_out
            + 2 * seq * attn_out * h
        )

    def mlp(width: int) -> int:
        return 2 * seq * h * width * (3 if m.swiglu else 2)

    dense = m.num_layers - m.moe_layers
    moe = 2 * seq * h * (m.num_experts or 0) + m.moe_router_topk * mlp(m.expert_ffn_size)
    moe += mlp(m.moe_shared_expert_intermediate_size or 0)
    spans = m.keys_per_query(seq)
    layers = sum(attention(k) for k in spans) + dense * mlp(m.ffn_size) + m.moe_layers * moe
    logits = 2 * seq * h * m.padded_vocab_size(1)
    last = moe if m.is_moe_layer(m.num_layers - 1) else mlp(m.ffn_size)
    mtp = (m.mtp_num_layers or 0) * (attention(spans[-1]) + last + 4 * seq * h * h + logits)
    forward = layers + logits + mtp
    return (4 if recompute else 3) * forward


def start_lines(cfg, family) -> list[str]:
    """What a run says once, at start: the model's size (nanoGPT's "number of parameters"; the
    whole model, counted on a TP = 1 copy built on the meta device, for the causal-LM families),
    the pipeline schedule that runs (with DualPipeV's overlapped pairs), and that nothing will
    be kept when --save is not given."""
    lines = []
    if family.causal_lm:
        with torch.device("meta"):
            model = family.reference_model(cfg.model, family.name)
        n = sum(p.numel() for p in model.parameters())
        lines.append(f" number of parameters: {n / 1e6:.2f}M ({n:,}, the whole model)")
    par, training = cfg.parallel, cfg.training
    if par.pipeline_model_parallel_size > 1 and not cfg.deepspeed.enabled:
        M = training.global_batch_size // (training.micro_batch_size * par.data_parallel_size)
        V = par.virtual_pipeline_size(cfg.model.num_layers) or 1
        P, overlap = par.pipeline_model_parallel_size, overlaps_moe_pairs(cfg)
        lines.append(par.schedule.start_line(P, M, V, overlap))
    if not cfg.checkpoint.save:
        lines.append(
            "note: no --save: this run writes no checkpoint (pass --save DIR to keep the model)"
        )
    return lines


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in KNOWN_PEAK_TFLOPS.items() if k in name), None)


def memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def iteration_line(
    *,
    iteration,
    train_iters,
    consumed,
    ms_per_iter,
    lr,
    global_batch,
    loss,
    loss_scale,
    grad_norm,
    skipped,
    nan,
    tokens_per_s,
    tflops,
    mfu,
    others=None,
) -> str:
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed:12d}",
        f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
        f"learning rate: {lr:.3E}",
        f"global batch size: {global_batch:5d}",
        f"lm loss: {loss:.6E}",
        *(f"{name}: {value:.6E}" for name, value in (others or {}).items()),
        f"loss scale: {loss_scale:.1f}",
        f"grad norm: {grad_norm:.3f}" if grad_norm is not None else "grad norm: -",
        f"number of skipped iterations: {skipped:3d}",
        f"number of nan iterations: {nan:3d}",
        f"tokens per second: {tokens_per_s:.1f}",
        f"TFLOP/s per device: {tflops:.2f}",
    ]
    if mfu is not None:
        parts.append(f"MFU: {mfu:.1f}%")
    return " | ".join(parts) + " |"


def _power_of_two(x: float) -> str:
    k = math.log2(x) if x > 0 else math.nan
    return f"{x:.0f} (2^{k:.0f})" if k == round(k) else f"{x:g}"


def loss_scale_warmup_line(rows: list[dict], hysteresis: int, initial: float) -> str | None:
    """Why the first of `rows` (a run's first settled steps) were skipped, when their fp16
    gradients overflowed with a finite loss: the dynamic loss scale starts high and halves on
    overflow until the gradients fit. Megatron only counts skips in the next iteration line,
    which a short run may never print (None: the first row was not such a skip)."""
    skipped = []
    for row in rows:
        if row["updated"] or not math.isfinite(row["lm_loss"]):
            break
        skipped.append(row)
    if not skipped:
        return None
    first, last = skipped[0]["iteration"], skipped[-1]["iteration"]
    which = f"iteration {first} was" if first == last else f"iterations {first}-{last} were"
    return (
        f" {which} skipped for fp16 loss scaling: the gradients overflowed at the dynamic loss "
        f"scale, which starts at --initial-loss-scale {_power_of_two(initial)} and halves on "
        f"each overflow (once --hysteresis {hysteresis} have happened) until they fit, so an fp16 "
        f"run's first steps are skipped; it is now {_power_of_two(skipped[-1]['loss_scale'])}. "
        "A short run can start lower (e.g. --initial-loss-scale 65536)"
    )


def validation_line(iteration: int, loss: float, split: str = "validation") -> str:
    ppl = math.exp(min(20.0, loss))
    return (
        f" {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
        f"lm loss PPL: {ppl:.6E} |"
    )


class TensorBoard:
    """Scalars on the logging rank only; a no-op without --tensorboard-dir."""

    def __init__(self, log_dir: str | None, enabled: bool):
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, values: dict[str, float], iteration: int, consumed: int) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is None:
                continue
            self.writer.add_scalar(name, value, iteration)
            if name in ("lm-loss", "validation lm-loss"):
                self.writer.add_scalar(f"{name} vs samples", value, consumed)

    def text(self, name: str, text: str) -> None:
        if self.writer is not None:
            # TensorBoard renders markdown: indented by 4 spaces, the text is a code block.
            self.writer.add_text(name, textwrap.indent(text, "    "), 0)

    def run_config(self, text: str) -> None:
        self.text("run-config", text)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class MetricsSinks:
    """Where the loop's scalars go: each sink has scalars(values, iteration, consumed samples),
    run_config(yaml text) and close(); a sink that is off does nothing."""

    def __init__(self, *sinks):
        self.sinks = sinks

    def scalars(self, values: dict[str, float], iteration: int, consumed: int) -> None:
        for sink in self.sinks:
            sink.scalars(values, iteration, consumed)

    def run_config(self, text: str) -> None:
        for sink in self.sinks:
            sink.run_config(text)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_metrics_sinks(lg: LoggingConfig, save: str | None, enabled: bool) -> MetricsSinks:
    """TensorBoard with --tensorboard-dir, W&B with --wandb-project (imported only then)."""
    sinks = [TensorBoard(lg.tensorboard_dir, enabled)]
    if lg.wandb_project:
        from megatron.training.wandb_log import WandB

        sinks.append(WandB(lg, save, enabled))
    return MetricsSinks(*sinks)
