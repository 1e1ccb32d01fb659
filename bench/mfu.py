"""Model FLOPs utilization on one device: ours vs Megatron-core vs Hugging Face GPT-2, bf16.

    python bench/mfu.py [--shapes gpt2-medium,gpt-1.3b,gpt-2.7b] [--systems ours,mcore,hf]
                        [--warmup 3] [--steps 10] [--mcore-dir DIR] [--json FILE]
    python bench/mfu.py --smoke        (the CPU: a tiny shape; Megatron-core is built, not run)

Every system trains the same GPT (learned positions, LayerNorm, GeLU MLP 4h, tied embedding,
the vocabulary padded to a multiple of 128) on the same four random (tokens, labels) batches,
one after the other in this command, in bf16 with fp32 weights for the optimizer:
  ours   GPTModel + our DDP buffer + MegatronOptimizer (fused AdamW), SDPA attention and the
         Triton kernels where they run (`--ours-variants default,compile` adds torch.compile)
  mcore  Megatron-core GPTModel with get_gpt_layer_local_spec() (no Transformer Engine),
         Float16Module, its DistributedDataParallel and get_megatron_optimizer, in a process of
         its own (bench/mcore_arm.py: its `megatron` namespace and ours cannot share a process)
  hf     transformers GPT2LMHeadModel, attn_implementation="sdpa", fp32 weights under bf16
         autocast, fused AdamW, torch.compile (what a user would pick instead)
The largest shape uses selective recompute (ours and Megatron-core: the attention core; Hugging
Face has only whole-layer gradient checkpointing). Warm-up steps (compilation included) are not
timed; the step time is the median of the timed steps. TFLOP/s use Megatron-LM's model-FLOPs
formula (`megatron_flops_per_sample`) without a recompute term, and MFU is given against the bf16
matmul peak measured here and against the H100's 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.train_step import build_ours  # noqa: E402
from megatron.config.schema import KernelConfig, ModelConfig, RecomputeConfig  # noqa: E402
from megatron.fused_kernels import select_ops  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.models.gpt.model import build_model  # noqa: E402

H100_PEAK = 989.0  # dense bf16 TFLOP/s of an H100 SXM
DATA_SEED = 0


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    recompute: bool = False  # selective recompute (the attention core)
    vocab: int = 50257  # padded to a multiple of 128 for every system


SHAPES = {
    "gpt2-medium": Shape(24, 1024, 16, seq=1024, batch=16),
    "gpt-1.3b": Shape(24, 2048, 16, seq=2048, batch=8),
    # The largest of these that fits one 80 GB H100 with fp32 Adam state (~18 bytes/param):
    # 2.7B params -> ~49 GB of weights, gradients and optimizer state, ~12 GB of activations.
    "gpt-2.7b": Shape(32, 2560, 32, seq=2048, batch=2, recompute=True),
    "tiny": Shape(2, 64, 4, seq=32, batch=2, vocab=1000),  # --smoke
}


def model_config(shape: Shape) -> ModelConfig:
    return ModelConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        seq_length=shape.seq,
        max_position_embeddings=shape.seq,
        vocab_size=shape.vocab,
        make_vocab_size_divisible_by=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def megatron_flops_per_sample(m: ModelConfig, seq: int) -> float:
    """Model FLOPs to train on one sample, as Megatron-LM counts them (`transformer_flops` in
    megatron/training/training.py, megatron-core 0.19) for a dense GPT without recompute.

    3 (forward, backward for inputs and for weights) x 2 (multiply-add) x, per token: per layer
    the projections h (q + 2 g d) + q h and the MLP h f (x 3/2 with SwiGLU, as 2 or 3 matmuls),
    plus the logits h V; and per sequence of s tokens s^2 q per layer for QK^T and PV, halved
    for the causal mask. (The trainer's log line, megatron.training.log, counts the whole s^2
    term, as the 2021 Megatron paper did: its MFU reads higher by that share.)
    """
    h, q = m.hidden_size, m.num_attention_heads * m.head_dim
    kv = 2 * m.query_groups * m.head_dim
    mlp = h * m.ffn_size * (3 if m.swiglu else 2)
    per_token = m.num_layers * (h * (q + kv) + q * h + mlp) + h * m.padded_vocab_size(1)
    per_sequence_core = m.num_layers * seq * seq * q / 2 * 2  # causal half of QK^T and PV
    return 3 * 2 * (seq * per_token + per_sequence_core)


def batches(shape: Shape, vocab: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The four (tokens, labels) batches every system trains on (bench/mcore_arm.py draws the
    same ones from the same generator)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for _ in range(4):
        tokens = torch.randint(0, vocab, (shape.batch, shape.seq), generator=g)
        labels = torch.randint(0, vocab, (shape.batch, shape.seq), generator=g)
        out.append((tokens.to(device), labels.to(device)))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step(step, device, warmup: int, steps: int) -> float:
    """Median seconds of step(i) over `steps` calls after `warmup` untimed ones."""
    times = []
    for i in range(warmup + steps):
        sync(device)
        t = time.perf_counter()
        step(i)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak(device: torch.device, smoke: bool) -> float:
    """Measured TFLOP/s of a large bf16 matmul (the ceiling a training step can approach)."""
    n = 256 if smoke else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_step(lambda i: a @ b, device, warmup=3, steps=5 if smoke else 20)
    return 2 * n**3 / seconds / 1e12


def free_memory(device: torch.device) -> None:
    torch._dynamo.reset()  # compiled graphs hold references to the modules they traced
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


# --- the three systems --------------------------------------------------------------------


def our_param_count(cfg: ModelConfig) -> int:
    model = build_model(cfg, BuildContext(seed=1, device="meta"))
    return sum(p.numel() for p in model.parameters())


def run_ours(shape: Shape, device, args, variant: str) -> dict:
    cfg = model_config(shape)
    kernels = KernelConfig(torch_compile=variant == "compile")
    ops = select_ops(kernels, device)
    recompute = RecomputeConfig(granularity="selective") if shape.recompute else None
    step_fn = build_ours(
        cfg,
        device,
        torch.bfloat16,
        ops=ops,
        torch_compile=kernels.torch_compile,
        recompute=recompute,
    )
    data = batches(shape, cfg.padded_vocab_size(1), device)

    def iterator():
        while True:
            yield from data

    it = iterator()
    seconds = median_step(lambda i: step_fn(it), device, args.warmup, args.steps)
    note = ops.describe().removeprefix("fused kernels: ")
    return {"step_s": seconds, "memory_gib": memory_gib(device), "note": note}


def hf_model(shape: Shape, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    conf = GPT2Config(
        vocab_size=vocab,
        n_positions=shape.seq,
        n_embd=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    conf._attn_implementation = "sdpa"
    return GPT2LMHeadModel(conf)


def run_hf(shape: Shape, device, args) -> dict:
    vocab = model_config(shape).padded_vocab_size(1)
    model = hf_model(shape, vocab).to(device)  # fp32 weights; bf16 compute under autocast
    if shape.recompute:
        model.gradient_checkpointing_enable()
    model.train()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    forward = torch.compile(model, backend=args.compile_backend)
    data = batches(shape, vocab, device)

    def step(i):
        tokens, labels = data[i % len(data)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(input_ids=tokens).logits  # (b, s, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = median_step(step, device, args.warmup, args.steps)
    note = f"sdpa, torch.compile({args.compile_backend})"
    if shape.recompute:
        note += ", full gradient checkpointing"
    return {
        "step_s": seconds,
        "memory_gib": memory_gib(device),
        "params": sum(p.numel() for p in model.parameters()),
        "note": note,
    }


def start_mcore(shape: Shape, device, args):
    """Start Megatron-core's arm: a subprocess whose path holds its install, not this repo.
    Returns (process, spec, working directory) or a result dict saying why it did not start."""
    if not args.mcore_dir or not os.path.isdir(os.path.join(args.mcore_dir, "megatron", "core")):
        return {"skipped": f"no megatron-core install at --mcore-dir {args.mcore_dir!r}"}
    spec = {
        **asdict(shape),
        "vocab": model_config(shape).padded_vocab_size(1),
        "device": device.type,
        "warmup": args.warmup,
        "steps": args.steps,
        "data_seed": DATA_SEED,
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.path.abspath(args.mcore_dir)
    cwd = tempfile.TemporaryDirectory()  # the repository is not the working directory
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "bench", "mcore_arm.py"), json.dumps(spec)],
        cwd=cwd.name,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, spec, cwd


def finish_mcore(started, args, log) -> dict:
    if isinstance(started, dict):
        return started
    proc, spec, cwd = started
    try:
        stdout, stderr = proc.communicate(timeout=args.mcore_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {args.mcore_timeout} s)"
    finally:
        cwd.cleanup()
    log.write(f"--- megatron-core arm {spec}\n{stdout}\n{stderr}\n")
    line = next((x for x in stdout.splitlines() if x.startswith("MCORE_RESULT ")), None)
    if line is None:
        tail = (stderr or stdout).strip().splitlines()[-2:]
        return {"error": f"exit {proc.returncode}: " + " / ".join(tail)}
    result = json.loads(line.removeprefix("MCORE_RESULT "))
    if "version" in result:
        result["note"] = f"megatron-core {result['version']}, local spec"
    return result


# --- the table ----------------------------------------------------------------------------


def figures(result: dict, shape: Shape, cfg: ModelConfig, peak: float) -> dict:
    seconds = result["step_s"]
    tflops = shape.batch * megatron_flops_per_sample(cfg, shape.seq) / seconds / 1e12
    return {
        "tokens_per_s": shape.batch * shape.seq / seconds,
        "tflops": tflops,
        "mfu_measured_peak": 100 * tflops / peak,
        "mfu_989": 100 * tflops / H100_PEAK,
    }


def print_row(name: str, system: str, r: dict) -> None:
    if "step_s" not in r:
        why = r.get("error") or r.get("skipped")
        status = "ERROR" if "error" in r else "skipped"
        print(f"{name:12s} {system:14s} {status}: {why}", flush=True)
        return
    mem = f"{r['memory_gib']:.1f}" if r.get("memory_gib") is not None else "-"
    print(
        f"{name:12s} {system:14s} {1000 * r['step_s']:9.1f} {r['tokens_per_s']:10.0f} "
        f"{r['tflops']:8.1f} {r['mfu_measured_peak']:9.1f}% {r['mfu_989']:8.1f}% {mem:>7s}  "
        f"{r.get('note', '')}",
        flush=True,
    )


def measure_shape(name: str, device, args, peak: float, log) -> list[dict]:
    shape = SHAPES[name]
    cfg = model_config(shape)
    ours_params = our_param_count(cfg)
    rows = []
    # On the CPU Megatron-core's arm only builds its model: start it now, alongside ours and HF.
    # On a GPU it starts in its turn, after the others gave their memory back.
    early = (
        start_mcore(shape, device, args)
        if "mcore" in args.systems and device.type == "cpu"
        else None
    )
    for system in args.systems:
        variants = args.ours_variants if system == "ours" else [None]
        for variant in variants:
            label = system if variant in (None, "default") else f"{system} ({variant})"
            try:
                if system == "ours":
                    r = run_ours(shape, device, args, variant)
                    r["params"] = ours_params
                elif system == "hf":
                    r = run_hf(shape, device, args)
                else:
                    started = early if early is not None else start_mcore(shape, device, args)
                    r = finish_mcore(started, args, log)
            except torch.OutOfMemoryError:
                r = {"error": "out of memory"}
            except Exception as e:  # one system failing must not hide the others
                r = {"error": f"{type(e).__name__}: {e}"}
            free_memory(device)
            if "params" in r and r["params"] != ours_params:
                r = {"error": f"{r['params']} parameters, ours {ours_params}: not the same model"}
            elif "skipped" in r and "params" in r:
                r["skipped"] += f"; its {r['params']:,} parameters equal ours"
            if "step_s" in r:
                r.update(figures(r, shape, cfg, peak))
            rows.append({"shape": name, "system": label, **r})
            print_row(name, label, r)
    return rows


def headline(rows: list[dict]) -> str:
    parts = []
    for name in dict.fromkeys(r["shape"] for r in rows):
        cells = [
            f"{r['system']} {r['mfu_989']:.1f}%" if "mfu_989" in r else f"{r['system']} -"
            for r in rows
            if r["shape"] == name
        ]
        parts.append(f"{name}: " + ", ".join(cells))
    return "MFU vs 989: " + "; ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="gpt2-medium,gpt-1.3b,gpt-2.7b", help="of " + str(SHAPES))
    p.add_argument("--systems", default="ours,mcore,hf")
    p.add_argument("--ours-variants", default="default", help="default and/or compile")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported")
    p.add_argument("--mcore-dir", default=os.environ.get("MCORE_DIR"), help="pip --target dir")
    p.add_argument("--mcore-timeout", type=int, default=300, help="seconds per shape")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile of the HF arm")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--log", help="append the Megatron-core subprocess output here")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 1 + 2 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.warmup, args.steps = "tiny", 1, 2
        # Inductor's C++ codegen takes minutes on a small CPU; "eager" still runs dynamo.
        args.compile_backend = "eager"
    args.systems = args.systems.split(",")
    args.ours_variants = args.ours_variants.split(",")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown or not set(args.systems) <= {"ours", "mcore", "hf"}:
        p.error(f"--shapes from {list(SHAPES)}, --systems from ours,mcore,hf (got {unknown})")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(0)
    peak = matmul_peak(device, args.smoke)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}  torch {torch.__version__}  measured matmul peak: {peak:.1f} TFLOP/s")
    print(
        f"{'shape':12s} {'system':14s} {'step ms':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} "
        f"{'MFU meas':>10s} {'MFU 989':>9s} {'GiB':>7s}  notes"
    )
    rows = []
    with open(args.log or os.devnull, "a") as log:
        for shape_name in args.shapes.split(","):
            rows += measure_shape(shape_name, device, args, peak, log)
            if args.json:  # after every shape: a run cut short by its time limit keeps them
                with open(args.json, "w") as f:
                    json.dump({"device": name, "peak_tflops": peak, "rows": rows}, f, indent=1)
    print("HEADLINE " + headline(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
