"""Megatron-core's arm of bench/mfu.py, run in a process of its own.

    python bench/mcore_arm.py '<json spec>'      (started by bench/mfu.py; prints one JSON line)

Megatron-core installs `megatron/core` into the `megatron` namespace, which this repository's
own `megatron` package shadows, so this file imports nothing from the repository and must run
with the megatron-core install on its path and the repository off it (bench/mfu.py starts it with
PYTHONPATH = that install and the working directory elsewhere). It builds `GPTModel` with
`get_gpt_layer_local_spec()` (Megatron-core's own modules, no Transformer Engine), wraps it as
Megatron's trainer does (Float16Module, its DistributedDataParallel with an fp32 gradient buffer,
`get_megatron_optimizer`: fp32 main weights and Adam), and times training steps on the batches
the spec describes. The API used is the same in megatron-core 0.16 and 0.19. With spec "te" it
builds `get_gpt_layer_with_transformer_engine_spec()` instead (Transformer Engine installed).

It runs at the largest micro-batch that fits: on out-of-memory it halves the micro-batch and
accumulates gradients over as many micro batches as keep the tokens per step (reported as
`micro_batch`, `accumulation` and the sizes that ran out of memory).

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
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
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
    if spec.get("te"):
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec()
    model = GPTModel(
        config,
        layer_spec,
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

    texts = _batches(spec)
    seconds, micro, oom = largest_fitting(
        spec["batch"], lambda m: _time_steps(spec, model, optimizer, texts, m)
    )
    out["out_of_memory"] = oom
    if seconds is None:
        out["error"] = f"out of memory at micro-batch {'/'.join(map(str, oom))}"
        return out
    out["step_s"], out["micro_batch"], out["accumulation"] = seconds, micro, spec["batch"] // micro
    out["memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def largest_fitting(batch: int, attempt):
    """(attempt(micro)'s value, micro, the micro-batches that ran out of memory), halving the
    micro-batch from `batch` on each out-of-memory error; (None, 0, [...]) when 1 does not fit."""
    import torch

    oom = []
    micro = batch
    while micro >= 1:
        try:
            return attempt(micro), micro, oom
        except torch.OutOfMemoryError:
            oom.append(micro)
        # Out of the except block: the failed step's frames (and activations) are released.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        micro //= 2
    return None, 0, oom


def _batches(spec: dict):
    """The same four (b, s + 1) token batches as the other arms (bench/mfu_common.batches:
    same generator, same order), on the GPU."""
    import torch

    g = torch.Generator().manual_seed(spec["data_seed"])
    shape = (spec["batch"], spec["seq"] + 1)
    return [torch.randint(0, spec["vocab"], shape, generator=g).cuda() for _ in range(4)]


def _time_steps(spec: dict, model, optimizer, texts, micro: int) -> float:
    """Median seconds of a step of spec["batch"] samples as batch / micro micro batches."""
    import torch

    accumulation = spec["batch"] // micro
    position_ids = torch.arange(spec["seq"], device="cuda").expand(micro, spec["seq"])

    def step(i: int) -> None:
        text = texts[i % len(texts)]  # (b, s + 1)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for chunk in text.split(micro):  # (micro, s + 1) each
            tokens, labels = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
            losses = model(tokens, position_ids, None, labels=labels)  # (micro, s) per token
            (losses.float().mean() / accumulation).backward()
        model.finish_grad_sync()
        optimizer.step()

    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except Exception as e:  # reported in bench/mfu.py's table, with the type and message
        result = {"error": f"{type(e).__name__}: {e}"}
    print("MCORE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
