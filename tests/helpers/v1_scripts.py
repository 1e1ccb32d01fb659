"""Megatron-LM v1.1.5's example training scripts (examples/*.sh of DeepSpeedExamples'
Megatron-LM-v1.1.5-3D_parallelism), for tests/entry_points/test_v1_scripts.py,
test_v1_ds_scripts.py and test_v1_ds_pipe_script.py (one file per slow script, so that
pytest-xdist's workers share them). They run with their command lines unchanged except:

- sizes scaled down to a CPU (layers, hidden size, heads, sequence, batch, iterations, intervals,
  ranks: model-parallel size and process count), each marked `# v1.x: <original>`;
- `--distributed-backend nccl` -> gloo (no GPU);
- the DeepSpeed scripts: fp16 -> bf16, the one substitution. DeepSpeed refuses fp16 on this CPU
  ("Type fp16 is not supported on your device": torch.ops.mkldnn._is_mkldnn_fp16_supported() is
  False), and allows bf16. So `--fp16` -> `--bf16` and the JSON's "fp16" section ->
  "bf16": {"enabled": true} (its loss-scaling keys are fp16's; DeepSpeed's bf16 section forbids
  them). The JSONs' train_batch_size is scaled with the batch.
  (Our own backend runs `--fp16` on the CPU: pretrain_gpt2.sh keeps it.)

Data: a tiny corpus tokenized with a tiny GPT-2 BPE vocab (tests/fixtures/megatron-mmap), as
the scripts expect gpt2-vocab.json / gpt2-merges.txt and a `_text_document` prefix.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "megatron-mmap"
PRETRAIN = str(ROOT / "pretrain_gpt2.py")

# examples/ds_zero_stage_2_config.json and examples/ds_config.json of v1.1.5, as shipped (both
# end in the same fp16 and logging settings).
_FP16_TAIL = {
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "wall_clock_breakdown": True,
    "zero_allow_untested_optimizer": False,
}
DS_ZERO_STAGE_2_CONFIG = {
    "train_batch_size": 2048,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1,
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 50000000,
        "reduce_bucket_size": 50000000,
        "overlap_comm": True,
    },
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]},
    },
    "gradient_clipping": 1.0,
    **_FP16_TAIL,
}
DS_CONFIG = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 10,
    "gradient_clipping": 1.0,
    **_FP16_TAIL,
}


def on_cpu(config: dict, train_batch_size: int) -> dict:
    """The one substitution (fp16 -> bf16) and the batch scaled to the CPU run."""
    out = {k: v for k, v in config.items() if k != "fp16"}
    out["bf16"] = {"enabled": True}
    out["train_batch_size"] = train_batch_size
    return out


def make_workdir(tmp_path_factory):
    """A directory laid out as the scripts expect (data/, vocab files, examples/)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from megatron.data.tokenizers import build_tokenizer

    root = tmp_path_factory.mktemp("v1")
    (root / "data" / "webtext").mkdir(parents=True)
    for name in ("gpt2-vocab.json", "data/gpt2-vocab.json"):
        shutil.copy(FIXTURES / "vocab.json", root / name)
    for name in ("gpt2-merges.txt", "data/gpt2-merges.txt"):
        shutil.copy(FIXTURES / "merges.txt", root / name)
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=root / "gpt2-vocab.json", merge_file=root / "gpt2-merges.txt"
    )
    texts = [json.loads(line)["text"] for line in open(FIXTURES / "corpus.jsonl")]
    prefix = root / "data" / "webtext" / "webtext_text_document"
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(6):  # 114 documents, 6.5k tokens
        for text in texts:
            builder.add_document([tok.tokenize(text) + [tok.eod]])
    builder.finalize(f"{prefix}.idx")
    (root / "examples").mkdir()
    return root


def run(cmd: list[str], cwd: Path, timeout: float = 540) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc.stdout


def gpt_options(checkpoint_path: str, data_path: str, vocab: str, merges: str) -> list[str]:
    """examples/pretrain_gpt2.sh's flags (pretrain_gpt2_distributed.sh: the same)."""
    return [
        "--num-layers", "2",  # v1.x: 24
        "--hidden-size", "32",  # v1.x: 1024
        "--num-attention-heads", "4",  # v1.x: 16
        "--batch-size", "2",  # v1.x: 8
        "--seq-length", "32",  # v1.x: 1024
        "--max-position-embeddings", "32",  # v1.x: 1024
        "--train-iters", "2",  # v1.x: 500000
        "--lr-decay-iters", "3",  # v1.x: 320000
        "--save", checkpoint_path,
        "--load", checkpoint_path,
        "--data-path", data_path,
        "--vocab-file", vocab,
        "--merge-file", merges,
        "--data-impl", "mmap",
        "--split", "949,50,1",
        "--distributed-backend", "gloo",  # v1.x: nccl
        "--lr", "0.00015",
        "--min-lr", "1.0e-5",
        "--lr-decay-style", "cosine",
        "--weight-decay", "1e-2",
        "--clip-grad", "1.0",
        "--warmup", ".01",
        "--checkpoint-activations",
        "--log-interval", "1",  # v1.x: 100
        "--save-interval", "2",  # v1.x: 10000
        "--eval-interval", "2",  # v1.x: 1000
        "--eval-iters", "1",  # v1.x: 10
        "--fp16",
    ]  # fmt: skip


def check(stdout: str, global_batch: int, checkpoint_dir: Path) -> None:
    assert " iteration        2/       2 |" in stdout, stdout[-2000:]
    assert f"global batch size: {global_batch:5d}" in stdout
    assert " validation loss at iteration 2 |" in stdout
    assert (checkpoint_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def ds_options(
    mp_size: int, pp_size: int | None, batch: int, gas: int | None, ck: str
) -> list[str]:
    """gpt_options of ds_pretrain_gpt2.sh / ds_pretrain_gpt2_pipe.sh (they differ in
    --pipe-parallel-size, --gas and the log/save/eval intervals)."""
    pipe = ["--pipe-parallel-size", str(pp_size)] if pp_size else []
    gas_flag = ["--gas", str(gas)] if gas else []
    return [
        "--model-parallel-size", str(mp_size),
        *pipe,
        "--num-layers", "2",  # v1.x: 24
        "--hidden-size", "32",  # v1.x: 1024
        "--num-attention-heads", "4",  # v1.x: 16
        "--seq-length", "32",  # v1.x: 1024
        "--max-position-embeddings", "32",  # v1.x: 1024
        "--batch-size", str(batch),
        *gas_flag,
        "--train-iters", "2",  # v1.x: 320000
        "--lr-decay-iters", "3",  # v1.x: 320000
        "--save", ck,
        "--load", ck,
        "--data-path", "data/webtext/webtext_text_document",
        "--vocab-file", "data/gpt2-vocab.json",
        "--merge-file", "data/gpt2-merges.txt",
        "--data-impl", "mmap",
        "--split", "949,50,1",
        "--distributed-backend", "gloo",  # v1.x: nccl
        "--lr", "1.5e-4",
        "--lr-decay-style", "cosine",
        "--min-lr", "1.0e-5",
        "--weight-decay", "1e-2",
        "--clip-grad", "1.0",
        "--warmup", "0.01",
        "--checkpoint-activations",
        "--log-interval", "1",  # v1.x: 100 (pipe: 1)
        "--save-interval", "2",  # v1.x: 10000 (pipe: 500)
        "--eval-interval", "2",  # v1.x: 1000 (pipe: 100)
        "--eval-iters", "1",  # v1.x: 10
        "--bf16",  # v1.x: --fp16 (DeepSpeed has no fp16 on this CPU)
        "--tensorboard-dir", f"tensorboard_data/{mp_size}mp_{batch}b_ds4",
    ]  # fmt: skip


def deepspeed_cmd(num_gpus: int, config_json: Path, options: list[str]) -> list[str]:
    stage, rbs, agbs, chkp_layers = 0, 50000000, 5000000000, 1  # the scripts' ZeRO settings
    deepspeed_options = ["--deepspeed", "--deepspeed_config", str(config_json)]
    deepspeed_options += ["--zero-stage", str(stage), "--zero-reduce-bucket-size", str(rbs)]
    deepspeed_options += ["--zero-allgather-bucket-size", str(agbs)]
    deepspeed_options += ["--zero-contigious-gradients", "--zero-reduce-scatter"]  # true, true
    chkp_opt = ["--checkpoint-activations", "--checkpoint-num-layers", str(chkp_layers)]
    chkp_opt += ["--partition-activations"]  # PA=true (PA_CPU=false)
    chkp_opt += ["--synchronize-each-layer", "--contigious-checkpointing"]  # SYNCHRONIZE, CC
    launcher = [shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"]
    launcher += ["--num_nodes", "1", "--num_gpus", str(num_gpus)]  # v1.x: 1 node, 8 / 16 GPUs
    return [*launcher, PRETRAIN, *options, *deepspeed_options, *chkp_opt]
