"""The other systems of bench/mfu.py: Hugging Face GPT-2 (+ torch.compile) in this process, and
Megatron-core (local spec, or Transformer Engine's where it is installed) in a process of its
own (bench/mcore_arm.py: its `megatron` namespace and ours cannot share a process)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

import torch
import torch.nn.functional as F

from bench.mfu_common import DATA_SEED, Shape, batches, median_step, memory_gib, model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TE_NOT_INSTALLABLE = (
    "Megatron-core with Transformer Engine cannot be installed on the GPU machine: "
    "transformer-engine-torch is published as a source distribution only (CUDA extensions "
    "built against the local torch at install time) and that machine has no network"
)


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
    """GPT2LMHeadModel with SDPA, fp32 weights under bf16 autocast, fused AdamW, compiled."""
    vocab = model_config(shape).padded_vocab_size(1)
    model = hf_model(shape, vocab).to(device)
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
        text = data[i % len(data)]  # (b, s + 1)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(input_ids=text[:, :-1]).logits  # (b, s, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), text[:, 1:].flatten())
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


def te_installed(mcore_dir: str | None) -> bool:
    """Whether `transformer_engine` is importable by Megatron-core's process."""
    path = ([os.path.abspath(mcore_dir)] if mcore_dir else []) + sys.path
    return importlib.machinery.PathFinder.find_spec("transformer_engine", path) is not None


def start_mcore(shape: Shape, device, args, te: bool = False):
    """Start Megatron-core's arm: a subprocess whose path holds its install, not this repo.
    Returns (process, spec, working directory) or a result dict saying why it did not start."""
    if te and not te_installed(args.mcore_dir):
        return {"skipped": TE_NOT_INSTALLABLE}
    if not args.mcore_dir or not os.path.isdir(os.path.join(args.mcore_dir, "megatron", "core")):
        return {"skipped": f"no megatron-core install at --mcore-dir {args.mcore_dir!r}"}
    spec = {
        **asdict(shape),
        "vocab": model_config(shape).padded_vocab_size(1),
        "device": device.type,
        "warmup": args.warmup,
        "steps": args.steps,
        "data_seed": DATA_SEED,
        "te": te,
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
        what = "Transformer Engine spec" if spec["te"] else "local spec"
        result["note"] = f"megatron-core {result['version']}, {what}"
        if result.get("micro_batch", spec["batch"]) != spec["batch"]:
            result["note"] += (
                f", micro-batch {result['micro_batch']} x {result['accumulation']} accumulated "
                f"(micro-batch {'/'.join(map(str, result['out_of_memory']))}: out of memory)"
            )
    return result
