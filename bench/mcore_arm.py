"""Megatron-core's arm of bench/mfu.py, run in a process of its own.

    python bench/mcore_arm.py '<json spec>'      (started by bench/mfu.py; prints one JSON line)

Megatron-core installs `megatron/core` into the `megatron` namespace, which this repository's
own `megatron` package shadows, so this file imports nothing from the repository and must run
with the megatron-core install on its path and the repository off it (bench/mfu.py starts it with
PYTHONPATH = that install and the working directory elsewhere). It builds `GPTModel` with
`get_gpt_layer_local_spec()` (Megatron-core's own modules, no Transformer Engine), wraps it as
Megatron's trainer does (Float16Module, its DistributedDataParallel with an fp32 gradient buffer,
`get_megatron_optimizer`: fp32 main weights and Adam), and times training steps on the batches
the spec describes. The API used is the same in megatron-core 0.16 and 0.19.

On the CPU it builds the model and reports its parameter count, then stops: Megatron-core's
forward needs CUDA (its causal mask and global memory buffer are allocated on "cuda").
"""

import json
import os
import statistics
import sys
import time


def _check_import_path() -> str:
    import megatron.core

    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron")
    where = os.path.abspath(megatron.core.__file__)
    if where.startswith(ours + os.sep):
        sys.exit(f"mcore_arm: megatron.core resolved inside this repository's package ({where})")
    return megatron.core.__version__


def _init_parallel(device_type: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def build(spec: dict):
    """(model as Megatron's trainer wraps it, optimizer or None on CPU, parameter count)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = spec["device"] == "cuda"
    _init_parallel(spec["device"])
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.cuda.set_device(0)
        model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=spec["layers"],
        hidden_size=spec["hidden"],
        num_attention_heads=spec["heads"],
        ffn_hidden_size=4 * spec["hidden"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=not cuda,
        recompute_granularity="selective" if spec["recompute"] else None,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=spec["vocab"],  # already padded by bench/mfu.py, as Megatron's trainer pads
        max_sequence_length=spec["seq"],
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    params = sum(p.numel() for p in model.parameters())
    if not cuda:
        return model, None, params

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    model = Float16Module(config, model.cuda())
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            weight_decay=0.01,
            bf16=True,
            params_dtype=torch.bfloat16,
            clip_grad=1.0,
        ),
        [model],
    )
    return model, optimizer, params


def run(spec: dict) -> dict:
    import torch

    version = _check_import_path()
    start = time.perf_counter()
    model, optimizer, params = build(spec)
    out = {"version": version, "params": params, "build_s": time.perf_counter() - start}
    if optimizer is None:
        out["skipped"] = (
            "built on the CPU only: Megatron-core's forward needs CUDA (its causal mask and "
            "global memory buffer are allocated on 'cuda')"
        )
        return out

    g = torch.Generator().manual_seed(spec["data_seed"])
    shape = (spec["batch"], spec["seq"])
    # The same four (tokens, labels) batches as the other arms (same generator, same order).
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, spec["vocab"], shape, generator=g)
        labels = torch.randint(0, spec["vocab"], shape, generator=g)
        batches.append((tokens.cuda(), labels.cuda()))
    position_ids = torch.arange(spec["seq"], device="cuda").expand(shape)

    def step(i: int) -> None:
        tokens, labels = batches[i % len(batches)]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = model(tokens, position_ids, None, labels=labels)  # (b, s) per-token losses
        losses.float().mean().backward()
        model.finish_grad_sync()
        optimizer.step()

    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
    out["step_s"] = statistics.median(times)
    out["memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except Exception as e:  # reported in bench/mfu.py's table, with the type and message
        result = {"error": f"{type(e).__name__}: {e}"}
    print("MCORE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
