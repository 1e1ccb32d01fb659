"""Megatron-LM v1.x command lines (as shipped with DeepSpeedExamples' v1.1.5): what they mean here.

Most v1.x spellings are aliases declared beside their setting (`--batch-size` =
`--micro-batch-size`, `--gas`, `--pipe-parallel-size`, `--min-scale`, `--DDP-impl`, ...). This
module holds what an alias cannot say:

- the v1.x flags this project refuses, each with the reason and the fix (`REFUSED`); they are
  on the parser (so `--help` lists them) and fail before any work when given;
- the v1.x defaults applied while resolving: `--pipe-parallel-size 0` ("no pipeline") is one
  stage, and pretrain_gpt2.py without `--tokenizer-type` but with `--vocab-file` uses
  GPT2BPETokenizer (without `--vocab-file` the data is pre-tokenized ids, `--vocab-size N`);
- the rules between the v1.x flags (`validate_compat`, called by megatron.config.rules).

The DeepSpeed JSON and the DeepSpeed flags are megatron.config.deepspeed_json's; the tokenizer
files megatron.config.tokenizer_files'.
"""

from __future__ import annotations

import argparse

from megatron.config.declare import ConfigError, fail
from megatron.config.deepspeed_json import fill_from_ds_json, validate_deepspeed_flags
from megatron.config.schema import MegatronConfig

_RETRIEVAL = (
    "ICT/REALM retrieval pretraining (v1.x pretrain_ict.py, the FAISS indexer) is not part of "
    "this project; pretrain_gpt2.py trains a GPT only. Fix: drop it"
)
_AUTORESUME = (
    "NVIDIA's internal ADLR cluster autoresume library (userlib.auto_resume) is not available. "
    "Fix: drop it; use --exit-signal-handler (save and exit 0 on SIGTERM) or "
    "--exit-duration-in-mins with a restarting launcher (torchrun --max-restarts): --load "
    "resumes exactly"
)
_LAZY_MPU = (
    "v1.x's hook for an external framework that creates the process groups itself "
    "(initialize_megatron() returned a function to finish the set-up later); pretrain_gpt2.py "
    "always creates them from the launcher's environment, so there is nothing to defer. "
    "Fix: drop it (to build the weights on the CPU first use --use-cpu-initialization)"
)

# flag -> (nargs as argparse takes it: 0 for a switch, None for one value, "+"), reason.
REFUSED: dict[str, tuple[object, str]] = {
    "--ict-head-size": (None, _RETRIEVAL),
    "--ict-load": (None, _RETRIEVAL),
    "--bert-load": (None, _RETRIEVAL),
    "--titles-data-path": (None, _RETRIEVAL),
    "--block-data-path": (None, _RETRIEVAL),
    "--indexer-batch-size": (None, _RETRIEVAL),
    "--indexer-log-interval": (None, _RETRIEVAL),
    "--faiss-use-gpu": (0, _RETRIEVAL),
    "--query-in-block-prob": (None, _RETRIEVAL),
    "--use-one-sent-docs": (0, _RETRIEVAL),
    "--report-topk-accuracies": ("+", _RETRIEVAL),
    "--adlr-autoresume": (0, _AUTORESUME),
    "--adlr-autoresume-interval": (None, _AUTORESUME),
    "--lazy-mpu-init": (None, _LAZY_MPU),
}
_REFUSED_DEST = "refused!"


def add_refused_arguments(parser: argparse.ArgumentParser) -> None:
    """The refused v1.x flags, listed in --help under their own group."""
    g = parser.add_argument_group("refused Megatron v1.x flags", "each fails, saying why")
    for flag, (nargs, reason) in REFUSED.items():
        kw = {"action": "store_true"} if nargs == 0 else {"nargs": nargs, "metavar": "X"}
        g.add_argument(
            flag,
            dest=_REFUSED_DEST + flag,
            default=argparse.SUPPRESS,
            help="refused: " + reason.split(". Fix")[0].replace("%", "%%"),
            **kw,
        )


def check_refused(ns: argparse.Namespace) -> None:
    for key in vars(ns):
        if key.startswith(_REFUSED_DEST):
            flag = key[len(_REFUSED_DEST) :]
            raise ConfigError(f"{flag}: {REFUSED[flag][1]}.")


# ---- resolving: v1.x defaults ----


# v1.x's tokenizer for a --vocab-file without --tokenizer-type, by entry point (pretrain_gpt2.py,
# pretrain_bert.py); the BERT tools use it without --vocab-file too (megatron.config.rules).
V1_DEFAULT_TOKENIZER = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}


def apply_v1_defaults(
    values: dict[str, object], default_tokenizer: str = V1_DEFAULT_TOKENIZER["gpt"]
) -> None:
    """v1.x meanings, in place, on {path: value} as given (file, flags, -o). A --vocab-file
    without --tokenizer-type means the entry point's v1.x default: GPT-2 BPE for
    pretrain_gpt2.py, BertWordPieceLowerCase for pretrain_bert.py."""
    if values.get("parallel.pipeline_model_parallel_size") == 0:
        values["parallel.pipeline_model_parallel_size"] = 1  # v1.x: 0 = no pipeline
    if (
        values.get("data.tokenizer.vocab_file")
        and not values.get("data.tokenizer.tokenizer_type")
        and not values.get("data.tokenizer.tokenizer_model_type")  # it names its own kind
    ):
        values["data.tokenizer.tokenizer_type"] = default_tokenizer
    fill_from_ds_json(values)


# ---- rules between the v1.x flags ----


def _validate_gas(cfg: MegatronConfig) -> None:
    t, dp = cfg.training, cfg.parallel.data_parallel_size
    gas = t.gradient_accumulation_steps
    if gas is None:
        return
    implied = t.micro_batch_size * dp * gas
    if t.global_batch_size is not None and t.global_batch_size != implied:
        fail(
            "--gas/--global-batch-size",
            f"--gas {gas} x --micro-batch-size {t.micro_batch_size} x DP {dp} = {implied} "
            f"contradicts --global-batch-size {t.global_batch_size}",
            "give one of them, or make them agree",
        )
    if t.rampup_batch_size is not None:
        fail("--gas", "fixes the batch, --rampup-batch-size grows it", "drop one of them")


def _validate_runtime(cfg: MegatronConfig) -> None:
    dist, d, r = cfg.distributed, cfg.deepspeed, cfg.recompute
    half = cfg.precision.fp16 or cfg.precision.bf16
    if dist.ddp_impl == "torch":
        if d.enabled:
            fail("--DDP-impl torch", "DeepSpeed's engine does the data parallelism", "drop it")
        if cfg.parallel.pipeline_model_parallel_size > 1:
            fail(
                "--DDP-impl torch",
                "torch DDP expects each forward to be followed by its backward, which a "
                "pipeline schedule does not do",
                "use --DDP-impl local with --pipeline-model-parallel-size > 1",
            )
        if half:
            fail(
                "--DDP-impl torch",
                "torch DDP accumulates and all-reduces gradients in the fp16/bf16 weights' dtype, "
                "not in fp32",
                "use --DDP-impl local (fp32 buffers; --allreduce-dtype params to halve traffic)",
            )
    if r.distribute_saved_activations:
        if r.granularity != "full":
            fail(
                "--distribute-checkpointed-activations",
                "splits the inputs of checkpointed layers, and activation checkpointing is off",
                "add --checkpoint-activations",
            )
        if d.enabled:
            fail(
                "--distribute-checkpointed-activations",
                "with --deepspeed, DeepSpeed's checkpointing does this",
                "use --partition-activations instead",
            )
    if d.enabled and cfg.checkpoint.no_save_optim:
        fail(
            "--no-save-optim",
            "DeepSpeed's engine always writes its optimizer (ZeRO) states with the weights",
            "drop it (or train without --deepspeed)",
        )


def validate_compat(cfg: MegatronConfig) -> None:
    """The rules of the v1.x flags; raises ConfigError naming the flag and the fix."""
    validate_deepspeed_flags(cfg)
    _validate_gas(cfg)
    _validate_runtime(cfg)
