"""Convert checkpoints: reshard to another TP x PP, export to / import from Hugging Face.

    python tools/convert_checkpoint.py --load ckpt --save ckpt_tp1 \\
        --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1
    python tools/convert_checkpoint.py --load ckpt --to-hf hf_model
    python tools/convert_checkpoint.py --from-hf hf_model --save ckpt \\
        --target-tensor-model-parallel-size 2
    python tools/convert_checkpoint.py --from-megatron-v1 v1_ckpt --save ckpt --vocab-size 50257
One CPU process, no torch.distributed. Resharding needs no offline step (--load of a checkpoint
saved at another layout reshards on load); this tool does the same offline, with the same code,
one target shard in memory at a time: the optimizer state of either kind is converted with the
weights (as the distributed optimizer's, which both optimizers load at any DP size); the RNG
states are not (resume with --no-load-rng). Hugging Face export holds the whole model once.
MoE checkpoints hold every expert whole (docs/moe.md): they convert like dense ones and resume
at any --expert-model-parallel-size, so there is no EP to convert.
"""

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.resharding import (  # noqa: E402
    load_checkpoint,
    model_config,
    save_resharded,
    validate_layout,
)
from megatron.checkpoint.storage import CheckpointError  # noqa: E402
from megatron.model import families  # noqa: E402
from megatron.progress import Progress  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", metavar="DIR", help="our checkpoint directory to read (any TP x PP)")
    src.add_argument(
        "--from-hf",
        metavar="DIR",
        help="Hugging Face directory to import: GPT-2, Llama, Mixtral, Qwen2-MoE, or a BERT "
        "((MegatronBert|Bert)For(PreTraining|MaskedLM))",
    )
    src.add_argument(
        "--from-megatron-v1",
        metavar="DIR",
        help="a GPT checkpoint directory of Megatron-LM v1.x (v1.1.5, DeepSpeedExamples; its "
        "own layout or its --deepspeed engine's, any TP, PP = 1) to import",
    )
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument(
        "--save", metavar="DIR", help="directory for the converted checkpoint (must not hold it)"
    )
    dst.add_argument("--to-hf", metavar="DIR", help="directory for the exported Hugging Face model")
    p.add_argument(
        "--target-tensor-model-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="TP size of the written checkpoint (default: the source's; 1 for --from-hf)",
    )
    p.add_argument(
        "--target-pipeline-model-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="PP size of the written checkpoint (default: the source's; 1 for --from-hf)",
    )
    p.add_argument(
        "--target-num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        metavar="N",
        help="lay stages out for the interleaved schedule (default: not interleaved)",
    )
    p.add_argument(
        "--iteration",
        type=int,
        default=None,
        metavar="N",
        help="with --load: the iteration to read (default: the latest complete one); "
        "with --from-hf: the iteration to write (default 0, Megatron's `release`)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="with --from-megatron-v1: the tokenizer's vocabulary size (v1.x saved the "
        "embedding padded; the rows after N are dropped). Default: read from the tokenizer "
        "files the checkpoint names, if they exist here",
    )
    p.add_argument(
        "--tokenizer-files",
        nargs="+",
        default=None,
        metavar="FILE",
        help="with --to-hf: vocab.json merges.txt and/or tokenizer.json to ship with the model "
        "(default: the files recorded in the checkpoint, if they still exist)",
    )
    return p


def _copy_tokenizer(tok: dict, save_dir: str) -> dict:
    """Copy the imported tokenizer files beside the checkpoint and point the args at them."""
    out = dict(tok)
    for key in ("vocab_file", "merge_file", "tokenizer_model"):
        if out.get(key):
            target = os.path.join(
                os.path.abspath(save_dir), "tokenizer", os.path.basename(out[key])
            )
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(out[key], target)
            out[key] = target
    return out


def _reshard(a) -> int:
    from megatron.checkpoint.convert_layout import convert_layout

    done = convert_layout(
        a.load,
        a.save,
        a.target_tensor_model_parallel_size,
        a.target_pipeline_model_parallel_size,
        a.target_num_layers_per_virtual_pipeline_stage,
        a.iteration,
        Progress("writing shards", unit="shard"),
    )
    print(done["note"], file=sys.stderr)
    saved = done["saved"]
    print(
        f"converted iteration {done['iteration']} of {a.load} (TP={saved.tp} x PP={saved.pp}, "
        f"padded vocab {done['padded_from']}) to {a.save} (TP={done['tp']} x PP={done['pp']}, "
        f"padded vocab {done['padded_to']})"
    )
    return 0


def _export(a) -> int:
    if a.target_tensor_model_parallel_size or a.target_pipeline_model_parallel_size:
        raise ValueError("--to-hf writes one unsharded model; drop the --target-* sizes")
    loaded = load_checkpoint(a.load, a.iteration, Progress("reading stages", unit="stage"))
    spec = families.spec_of_checkpoint_family(loaded.args.get("model_family"))
    if spec.hf_export is None:
        raise ValueError(f"--to-hf: the {spec.name} family has no Hugging Face mapping")
    name = spec.hf_export(loaded.state, loaded.args, a.to_hf, tokenizer_files=a.tokenizer_files)
    print(f"exported iteration {loaded.iteration} of {a.load} to {a.to_hf} as {name}")
    return 0


def _hf_importer(hf_cfg: dict):
    """The family that imports this Hugging Face `model_type` (else the default family's
    importer, which names what it cannot read)."""
    for spec in families.all_specs():
        if hf_cfg.get("model_type") in spec.hf_model_types:
            return spec.hf_import
    return families.get_spec(families.DEFAULT_FAMILY).hf_import


def _import(a) -> int:
    hf_cfg = _hf_config_json(a.from_hf)
    state, args = _hf_importer(hf_cfg)(a.from_hf, hf_cfg)
    cfg = model_config(args)
    tp = a.target_tensor_model_parallel_size or 1
    pp = a.target_pipeline_model_parallel_size or 1
    vp = a.target_num_layers_per_virtual_pipeline_stage
    validate_layout(cfg, tp, pp, vp)
    args["tokenizer"] = _copy_tokenizer(args["tokenizer"], a.save)
    save_resharded(
        state,
        args,
        a.save,
        tp,
        pp,
        a.iteration or 0,
        vp_layers=vp,
        quiet=True,
        progress=Progress("writing shards", unit="shard"),
    )
    print(
        f"imported {a.from_hf} to {a.save} (TP={tp} x PP={pp}); train from it with --load "
        f"{a.save} --finetune (the model flags must match: see args in the checkpoint)"
    )
    return 0


def _import_v1(a) -> int:
    from megatron.checkpoint.megatron_v1 import import_megatron_v1

    state, args, iteration = import_megatron_v1(a.from_megatron_v1, a.vocab_size, a.iteration)
    cfg = model_config(args)
    tp = a.target_tensor_model_parallel_size or 1
    pp = a.target_pipeline_model_parallel_size or 1
    vp = a.target_num_layers_per_virtual_pipeline_stage
    validate_layout(cfg, tp, pp, vp)
    save_resharded(
        state,
        args,
        a.save,
        tp,
        pp,
        iteration,
        vp_layers=vp,
        quiet=True,
        progress=Progress("writing shards", unit="shard"),
    )
    print(
        f"imported iteration {iteration} of Megatron-LM v1.x checkpoint {a.from_megatron_v1} "
        f"to {a.save} (TP={tp} x PP={pp}, vocab {cfg.vocab_size}); its weights only: continue "
        f"with --load {a.save} --no-load-optim --no-load-rng (from iteration {iteration}; "
        "Adam starts afresh) or --finetune, and the model flags of the v1.x run"
    )
    return 0


def _hf_config_json(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        return {}  # from_hf names the problem
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.from_hf and a.to_hf:
        print("error: --from-hf needs --save (our checkpoint format)", file=sys.stderr)
        return 1
    if a.vocab_size is not None and not a.from_megatron_v1:
        print("error: --vocab-size is only used with --from-megatron-v1", file=sys.stderr)
        return 1
    if a.tokenizer_files and not a.to_hf:
        print("error: --tokenizer-files is only used with --to-hf", file=sys.stderr)
        return 1
    try:
        if a.from_hf:
            return _import(a)
        if a.from_megatron_v1:
            if not a.save:
                print("error: --from-megatron-v1 needs --save", file=sys.stderr)
                return 1
            return _import_v1(a)
        return _reshard(a) if a.save else _export(a)
    except (ValueError, CheckpointError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
