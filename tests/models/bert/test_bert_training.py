"""pretrain_bert.py end to end: sentence-split preprocessing -> BERT training; TP / PP layouts
equal one process; exact resume; the v1.1.5 command line; bad input named."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.data.preprocess import main as preprocess_main
from tests.helpers.checkpoints import _cli as _convert_cli
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import ROOT

WORDS = [f"w{i}" for i in range(60)]
CJK = "天地人山水火木金土日月"


def _vocab(path):
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *CJK, "##s", ".", "。"]
    path.write_text("\n".join(pieces) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    """(PREFIX_text_sentence, PREFIX_text_document, vocab.txt) made by tools/preprocess_data.py."""
    d = tmp_path_factory.mktemp("bert")
    vocab = _vocab(d / "vocab.txt")
    rng = np.random.default_rng(0)
    with open(d / "corpus.jsonl", "w") as f:
        for i in range(80):
            sentences = []
            for _ in range(rng.integers(1, 7)):
                start = rng.integers(0, 50)
                words = [WORDS[(start + k) % 60] for k in range(rng.integers(3, 10))]
                sentences.append(" ".join(words) + ("s." if i % 5 else "."))
            text = " ".join(sentences)
            if i % 7 == 0:  # Chinese sentences end at 。
                text += "".join(CJK[(i + k) % 11] for k in range(4)) + "。天地。"
            f.write(json.dumps({"text": text}) + "\n")
    # tools/preprocess_data.py's main, in this process (one worker encodes inline)
    common = ["--input", str(d / "corpus.jsonl"), "--vocab-file", vocab]
    common += ["--tokenizer-type", "BertWordPieceLowerCase"]
    for extra in (["--split-sentences"], []):
        argv = [*common, *extra, "--output-prefix", str(d / "c"), "--workers", "1"]
        assert preprocess_main(argv) == 0, argv
    return str(d / "c_text_sentence"), str(d / "c_text_document"), vocab


def bert_flags(data, *extra, iters=4):
    sentence, _, vocab = data
    return [
        *("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 24").split(),
        *("--max-position-embeddings 24 --micro-batch-size 2 --global-batch-size 8").split(),
        *("--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --lr-warmup-iters 1").split(),
        *("--make-vocab-size-divisible-by 8 --split 90,10,0 --eval-interval 100").split(),
        *("--eval-iters 1 --num-workers 0 --log-interval 1 --seed 7 --adam-eps 1e-4").split(),
        *("--apply-residual-connection-post-layernorm --lr-decay-iters 8").split(),
        *["--train-iters", str(iters), "--data-path", sentence, "--vocab-file", vocab],
        *extra,
    ]


def _train(rank, world, argv):
    import torch

    import pretrain_bert
    from megatron.config.cli import parse_args
    from megatron.model.families import get_spec
    from megatron.training.loop import pretrain

    spec = get_spec("bert")
    cfg = parse_args(argv, world_size=world, purpose=spec.purpose)
    result = pretrain(cfg, family=spec, out=open(os.devnull, "w"))
    assert pretrain_bert.main  # the entry point imports
    state = {k: v.detach().clone() for k, v in result.model.module.state_dict().items()}
    torch.distributed.barrier()
    return result.history, {k: v.numpy() for k, v in state.items()}


def _losses(history, key="lm_loss"):
    return [h[key] for h in history]


def _layouts_worker(rank, world, argv, save_dir):
    out = {"straight": _train(rank, world, argv)[0]}
    first = list(argv)
    first[first.index("--train-iters") + 1] = "2"
    _train(rank, world, first + ["--save", save_dir])
    out["resumed"] = _train(rank, world, argv + ["--load", save_dir])[0]
    return out


@pytest.mark.slow
def test_tp2_and_pp2_equal_one_process_and_resume_exactly(bert_data, tmp_path):
    argv = bert_flags(bert_data)
    ((ref, _),) = run_distributed(_train, 1, argv)
    assert {"lm_loss", "nsp loss"} <= set(ref[0])
    for extra in (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):
        save = str(tmp_path / extra[0])
        for out in run_distributed(_layouts_worker, 2, argv + extra, save):
            for key in ("lm_loss", "nsp loss"):
                np.testing.assert_allclose(
                    _losses(out["straight"], key), _losses(ref, key), rtol=2e-5, err_msg=f"{extra}"
                )
                assert _losses(out["resumed"], key) == _losses(out["straight"], key)[2:], extra


@pytest.fixture(scope="module")
def three_steps(bert_data):
    """(bert_flags for 3 iterations, their one-process history): the reference that the
    TP2 x PP2 x DP2 and the DeepSpeed tests share (one spawn for both)."""
    argv = bert_flags(bert_data, iters=3)
    ((ref, _),) = run_distributed(_train, 1, argv)
    return argv, ref


@pytest.mark.slow
def test_tp2_pp2_dp2_equals_one_process(three_steps):
    argv, ref = three_steps
    extra = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    for out, _ in run_distributed(_train, 8, argv + extra):
        for key in ("lm_loss", "nsp loss"):
            np.testing.assert_allclose(_losses(out, key), _losses(ref, key), rtol=2e-5)


def _cli(*argv):
    return subprocess.run(
        [sys.executable, f"{ROOT}/pretrain_bert.py", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


@pytest.mark.slow
def test_v115_command_line_runs_and_bad_input_is_named(bert_data, tmp_path, capsys):
    sentence, document, vocab = bert_data
    # examples/pretrain_bert.sh of v1.1.5, sizes and paths shrunk, no GPU (no --fp16)
    v115 = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --batch-size 4 --seq-length 24 "
        "--max-position-embeddings 24 --train-iters 3 --data-impl mmap --split 949,50,1 "
        "--distributed-backend gloo --lr 0.0001 --min-lr 0.00001 --lr-decay-style linear "
        "--lr-decay-iters 990000 --weight-decay 1e-2 --clip-grad 1.0 --warmup .01 "
        "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 1"
    ).split()
    ckpt = str(tmp_path / "ckpt")
    # + the original BERT's post-LN order, so that the checkpoint has a Hugging Face twin
    paths = ["--save", ckpt, "--load", ckpt, "--vocab-file", vocab]
    paths += ["--apply-residual-connection-post-layernorm"]
    done = _cli(*v115, *paths, "--data-path", sentence)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lm loss" in done.stdout and "nsp loss" in done.stdout, done.stdout[-2000:]
    _check_conversions(ckpt, tmp_path)
    scored = subprocess.run(
        [sys.executable, f"{ROOT}/tools/evaluate_bert.py", *v115, *paths, "--data-path", sentence],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert scored.returncode == 0, scored.stderr[-2000:]
    metrics = dict(part.split(": ") for part in scored.stdout.strip().splitlines()[-1].split(" | "))
    assert set(metrics) == {"mlm loss", "mlm accuracy", "nsp accuracy"}, metrics
    assert 0 <= float(metrics["mlm accuracy"]) <= 1 and float(metrics["mlm loss"]) > 0
    # Refused command lines: the scripts' main() (what `python pretrain_*.py` exits with) run
    # here, as they fail before any distributed work; no process group is left behind.
    import pretrain_bert
    import pretrain_gpt2

    capsys.readouterr()
    status = pretrain_bert.main([*v115, *paths, "--data-path", document])
    err = capsys.readouterr().err
    assert status == 1 and "--split-sentences" in err, err[-2000:]
    assert not torch.distributed.is_initialized()
    status = pretrain_gpt2.main([*v115, *paths, "--mask-prob", "0.2"])
    err = capsys.readouterr().err
    assert status == 1 and "pretrain_bert.py" in err, err[-2000:]
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_deepspeed_zero1_dp2_equals_one_process(three_steps):
    argv, ref = three_steps
    for out, _ in run_distributed(_train, 2, argv + ["--deepspeed", "--zero-stage", "1"]):
        for key in ("lm_loss", "nsp loss"):
            np.testing.assert_allclose(_losses(out, key), _losses(ref, key), rtol=2e-5)


def _check_conversions(ckpt, tmp_path):
    """Reshard to TP2 x PP2 and back, export to BertForPreTraining (same logits), import."""
    import torch
    from transformers import BertForPreTraining

    from megatron.checkpoint.resharding import load_checkpoint, model_config
    from megatron.models.bert.model import BertModel

    convert = _convert_cli()
    original = load_checkpoint(ckpt)
    assert original.args["model_family"] == "bert"
    split = str(tmp_path / "tp2pp2")
    assert (
        convert(
            [
                "--load",
                ckpt,
                "--save",
                split,
                "--target-tensor-model-parallel-size",
                "2",
                "--target-pipeline-model-parallel-size",
                "2",
            ]
        )
        == 0
    )
    resharded = load_checkpoint(split)
    assert (resharded.tp, resharded.pp) == (2, 2)
    for name, t in original.state.items():
        assert torch.equal(resharded.state[name], t), name
    hf_dir = str(tmp_path / "hf")
    assert convert(["--load", split, "--to-hf", hf_dir]) == 0
    cfg = model_config(original.args)
    ours = BertModel(cfg).eval()
    padded = {}
    for name, t in original.state.items():
        rows = ours.state_dict()[name].shape[0]
        padded[name] = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    ours.load_state_dict(padded)
    hf = BertForPreTraining.from_pretrained(hf_dir).eval()
    tokens = torch.randint(5, cfg.vocab_size, (2, 10))
    types = torch.tensor([[0] * 5 + [1] * 5] * 2)
    pad = torch.ones(2, 10, dtype=torch.long)
    with torch.no_grad():
        logits, nsp = ours(tokens, pad, types)
        out = hf(input_ids=tokens, token_type_ids=types, attention_mask=pad)
    torch.testing.assert_close(
        logits[..., : cfg.vocab_size], out.prediction_logits, atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(nsp, out.seq_relationship_logits, atol=1e-4, rtol=1e-4)
    back = str(tmp_path / "back")
    assert convert(["--from-hf", hf_dir, "--save", back]) == 0
    for name, t in load_checkpoint(back).state.items():
        assert torch.equal(t, original.state[name]), name
