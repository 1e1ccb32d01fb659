"""Model FLOPs utilization on one device: our trainer's techniques vs Megatron-core vs Hugging
Face GPT-2, bf16, every shape and variant in one call.

    python bench/mfu.py [--shapes gpt2-small-b16,...] [--systems ours,trainer,mcore,mcore+TE,hf]
                        [--ours-variants default,compile,...] [--best-flags "FLAGS"]
                        [--variant-flags NAME=FLAGS ...] [--trainer-variants default]
                        [--warmup 3] [--steps 10] [--mcore-dir DIR] [--json FILE] [--log FILE]
    python bench/mfu.py --smoke   (the CPU, a tiny shape, every variant; Megatron-core is built,
                                   not run)

Every system trains the same GPT (learned positions, LayerNorm, GeLU MLP 4h, tied embedding,
the vocabulary padded to a multiple of 128) on the same four random token batches, one after
the other in this command, in bf16 with fp32 weights for the optimizer:
  ours      our trainer's step at the trainer's flags for the shape plus a variant's flags
            (bench/mfu_ours.py: parsed by our parser, built by the trainer's build_backend);
            a variant is a list of pretrain_gpt2.py flags, e.g. compile = --torch-compile
  trainer   pretrain_gpt2.py itself in a subprocess at the same flags (bench/mfu_trainer.py):
            its own data loader, loop and logging; ms/iteration from its log
  mcore     Megatron-core GPTModel with get_gpt_layer_local_spec() (no Transformer Engine),
            Float16Module, its DistributedDataParallel and get_megatron_optimizer, in a process
            of its own (bench/mcore_arm.py), at the largest micro-batch that fits (halved on
            out-of-memory, gradients accumulated to the same tokens per step; the note says so)
  mcore+TE  the same with Transformer Engine's layer spec, where transformer_engine imports;
            else a row saying why it cannot be installed on the GPU machine
  hf        transformers GPT2LMHeadModel, attn_implementation="sdpa", fp32 weights under bf16
            autocast, fused AdamW, torch.compile (what a user would pick instead)
The largest shape uses selective recompute (ours and Megatron-core: the attention core; Hugging
Face has only whole-layer gradient checkpointing). Warm-up steps (compilation included) are not
timed; the step time is the median of the timed steps. MFU is printed by two counts against the
H100's 989 TFLOP/s: "causal" = Megatron-LM's model FLOPs (the s^2 attention core halved for the
causal mask), "full" = the whole s^2 core, as llm-foundry, nanochat and our trainer's log line
count; "meas" = the causal count against the bf16 matmul peak measured here.

Rows print as they finish, and --json is rewritten after every row. A variant whose flags this
checkout's trainer does not declare gives an "ERROR: unknown flag ..." row (not counted in the
exit status, so the table runs while the flags are being added); one the trainer refuses (on
this device, say) a "refused" row with the trainer's reason. Other failures exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.mfu_common import (  # noqa: E402
    SHAPES,
    figures,
    free_memory,
    matmul_peak,
    model_config,
)
from bench.mfu_others import finish_mcore, run_hf, start_mcore  # noqa: E402
from bench.mfu_ours import BEST_FLAGS, VARIANTS, VariantError, run_ours, variant_table  # noqa: E402
from bench.mfu_trainer import run_trainer  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.models.gpt.model import build_model  # noqa: E402

SYSTEMS = ("ours", "trainer", "mcore", "mcore+TE", "hf")
ALL_VARIANTS = [*VARIANTS, "best"]
DEFAULT_SHAPES = "gpt2-small-b16,gpt2-small-b32,gpt2-small-b64,gpt2-medium,gpt-1.3b,gpt-2.7b"
COLUMNS = (
    f"{'shape':15s} {'system':24s} {'step ms':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} "
    f"{'MFU causal':>10s} {'MFU full':>9s} {'MFU meas':>9s} {'GiB':>6s}  notes"
)


def our_param_count(shape) -> int:
    model = build_model(model_config(shape), BuildContext(seed=1, device="meta"))
    return sum(p.numel() for p in model.parameters())


def run_system(system: str, variant: str | None, shape, device, args, log, early) -> dict:
    if system == "ours":
        return run_ours(shape, device, args, args.variants[variant])
    if system == "trainer":
        return run_trainer(shape, args, args.variants[variant], log)
    if system == "hf":
        return run_hf(shape, device, args)
    started = early.pop(system, None) or start_mcore(shape, device, args, te=system == "mcore+TE")
    return finish_mcore(started, args, log)


def one_row(system, variant, shape, device, args, log, early, ours_params) -> dict:
    """One system (and variant) at one shape: its figures, or why there are none."""
    try:
        r = run_system(system, variant, shape, device, args, log, early)
    except VariantError as e:  # unknown flag: an ERROR row; refused: the trainer's reason
        r = {"refused": str(e)} if e.kind == "refused" else {"error": str(e), "error_kind": e.kind}
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
        r.update(figures(r["step_s"], shape, args.peak))
    if variant is not None:
        r["variant"], r["flags"] = variant, args.variants[variant]
    return r


def print_row(name: str, system: str, r: dict) -> None:
    if "step_s" not in r:
        status = next(k for k in ("error", "refused", "skipped") if k in r)
        print(f"{name:15s} {system:24s} {status.upper()}: {r[status]}", flush=True)
        return
    mem = f"{r['memory_gib']:.1f}" if r.get("memory_gib") is not None else "-"
    print(
        f"{name:15s} {system:24s} {1000 * r['step_s']:9.1f} {r['tokens_per_s']:10.0f} "
        f"{r['tflops']:8.1f} {r['mfu_989']:9.1f}% {r['mfu_989_full']:8.1f}% "
        f"{r['mfu_measured_peak']:8.1f}% {mem:>6s}  {r.get('note', '')}",
        flush=True,
    )


def measure_shape(name: str, device, args, log, emit) -> None:
    """Every system (and variant) at shape `name`; `emit(row)` as each finishes."""
    shape = SHAPES[name]
    ours_params = our_param_count(shape)
    # On the CPU Megatron-core's arm only builds its model: start it now, beside the others.
    # On a GPU it starts in its turn, after the others gave their memory back.
    early = {
        s: start_mcore(shape, device, args, te=s == "mcore+TE")
        for s in ("mcore", "mcore+TE")
        if s in args.systems and device.type == "cpu"
    }
    for system in args.systems:
        variants = {"ours": args.ours_variants, "trainer": args.trainer_variants}
        for variant in variants.get(system, [None]):
            label = system if variant in (None, "default") else f"{system} ({variant})"
            r = one_row(system, variant, shape, device, args, log, early, ours_params)
            emit({"shape": name, "system": label, **r})
            print_row(name, label, r)


def headline(rows: list[dict]) -> str:
    """Per shape, each system's best MFU (causal / full, vs 989) and the variant that gave it."""
    parts = []
    for name in dict.fromkeys(r["shape"] for r in rows):
        best: dict[str, dict | None] = {}
        for r in (r for r in rows if r["shape"] == name):
            system = r["system"].split(" (")[0]
            if "mfu_989" in r and r["mfu_989"] > (best.get(system) or {}).get("mfu_989", -1):
                best[system] = r
            best.setdefault(system, None)
        cells = [
            f"{s} {r['mfu_989']:.1f}/{r['mfu_989_full']:.1f}%"
            + (f" ({r['variant']})" if r.get("variant") not in (None, "default") else "")
            if r
            else f"{s} -"
            for s, r in best.items()
        ]
        parts.append(f"{name}: " + ", ".join(cells))
    unknown = sorted({r.get("variant", r["system"]) for r in rows if r.get("error_kind")})
    tail = f"; variants with flags unknown here: {', '.join(unknown)}" if unknown else ""
    return "MFU vs 989 (causal/full): " + "; ".join(parts) + tail


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of " + ", ".join(SHAPES))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of those")
    p.add_argument(
        "--ours-variants",
        default=",".join(ALL_VARIANTS),
        help="comma list of variants of the ours arm, each a list of trainer flags: "
        + "; ".join(f"{k} = {' '.join(v) or '(bf16 defaults)'}" for k, v in VARIANTS.items())
        + "; best = --best-flags; and any --variant-flags name (default: all of them)",
    )
    p.add_argument("--best-flags", default=BEST_FLAGS, help="the trainer flags of variant `best`")
    p.add_argument(
        "--variant-flags",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help='add (or redefine) a variant: NAME="--flag value ..."; it runs in the ours arm '
        "also when --ours-variants does not name it (repeatable)",
    )
    p.add_argument(
        "--trainer-variants", default="default", help="variants the trainer row runs with"
    )
    p.add_argument("--trainer-iters", type=int, default=30, help="iterations of the trainer row")
    p.add_argument("--trainer-timeout", type=int, default=300, help="seconds per trainer row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported")
    p.add_argument("--mcore-dir", default=os.environ.get("MCORE_DIR"), help="pip --target dir")
    p.add_argument("--mcore-timeout", type=int, default=300, help="seconds per shape")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the HF arm and of the ours arm's --torch-compile",
    )
    p.add_argument("--json", help="write every row here (after every row)")
    p.add_argument("--log", help="append the subprocesses' output (mcore, trainer) here")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 1 + 2 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.warmup, args.steps, args.trainer_iters = "tiny", 1, 2, 6
        # Inductor's C++ codegen takes minutes on a small CPU; "eager" still runs dynamo.
        args.compile_backend = "eager"
    try:
        args.variants = variant_table(args.best_flags, args.variant_flags)
    except ValueError as e:
        p.error(str(e))
    args.systems = args.systems.split(",")
    args.ours_variants = args.ours_variants.split(",")
    args.ours_variants += [
        n.partition("=")[0].strip()
        for n in args.variant_flags
        if n.partition("=")[0].strip() not in args.ours_variants
    ]
    args.trainer_variants = args.trainer_variants.split(",")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    unknown += [s for s in args.systems if s not in SYSTEMS]
    unknown += [v for v in args.ours_variants + args.trainer_variants if v not in args.variants]
    if unknown:
        p.error(
            f"unknown {unknown}: --shapes from {list(SHAPES)}, --systems from {list(SYSTEMS)}, "
            f"variants from {list(args.variants)} (or add one with --variant-flags NAME=FLAGS)"
        )
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(0)
    args.peak = matmul_peak(device, args.smoke)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}  torch {torch.__version__}  measured matmul peak: {args.peak:.1f}")
    print(
        "TFLOP/s and MFU causal: Megatron-LM's model FLOPs (the s^2 attention core halved for "
        "the causal mask) vs 989 TFLOP/s; MFU full: the whole s^2 core (llm-foundry, nanochat, "
        "our trainer's log) vs 989; MFU meas: the causal count vs the measured matmul peak"
    )
    print(COLUMNS)
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        if args.json:  # after every row: a run cut short by its time limit keeps them
            with open(args.json, "w") as f:
                out = {"device": name, "peak_tflops": args.peak, "variants": args.variants}
                json.dump({**out, "rows": rows}, f, indent=1)

    with open(args.log or os.devnull, "a") as log:
        for shape_name in args.shapes.split(","):
            measure_shape(shape_name, device, args, log, emit)
    print("HEADLINE " + headline(rows))
    failed = [r for r in rows if "error" in r and r.get("error_kind") != "unknown-flag"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
