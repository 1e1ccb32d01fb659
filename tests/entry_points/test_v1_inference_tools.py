"""Megatron-LM v1.x (and 2019) inference command lines, scaled down: tools/generate_samples_gpt2.py,
tasks/main.py and scripts/run_gpt2_eval.py run unchanged (sizes, paths, process count and
--distributed-backend aside) and give the numbers of the library calls tools/generate_text.py
and tools/evaluate.py make; the training flags they pass must agree with the checkpoint.

fp16 on CPU: generation and evaluation run in fp16 on CPU (torch has CPU fp16 kernels for every
op the model uses), so the v1 generation command keeps its --fp16; exact comparisons use fp32.
"""

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.inference import evaluate_cli, generate_cli
from megatron.inference.engine import InferenceModel, load_inference_model
from megatron.inference.evaluation import evaluate_lambada, evaluate_loose_json, evaluate_wikitext
from megatron.inference.generation import SamplingParams, generate
from megatron.inference.samples import interactive, unconditional_samples
from megatron.inference.session import setup
from megatron.initialize import shutdown_distributed
from megatron.model.context import BuildContext
from megatron.models.gpt.model import build_model
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.paths import MMAP, ROOT
from tests.helpers.serving import WIKI

TOKENIZER = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(MMAP / "vocab.json")]
TOKENIZER += ["--merge-file", str(MMAP / "merges.txt")]
SHAPES = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --max-position-embeddings 64"
LAMBADA = [
    "The quick brown fox jumps over the lazy dog",
    "def main(args): return args",
    "import os and import sys",
    "Pipeline parallelism splits the layers",
    "A tensor is split across the ranks",
]


def _tok():
    return build_tokenizer(
        "GPT2BPETokenizer", vocab_file=MMAP / "vocab.json", merge_file=MMAP / "merges.txt"
    )


def _run(*argv, env=None, stdin=None) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=240,
        input=stdin,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return out


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """The fixture checkpoint as the tools load it (one process, fp32, no process group)."""
    rt = SimpleNamespace(
        state=mpu.single_process_state(), device=torch.device("cpu"), rng_tracker=None
    )
    engine, tokenizer, _ = load_inference_model(checkpoint, rt)
    return rt, engine, tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    (root / "wiki.tokens").write_text(WIKI)
    (root / "prompts.txt").write_text("def main(\nThe quick brown fox\n")
    return root


def test_generate_samples_gpt2_v1_command_writes_unconditional_json_lines(checkpoint, tmp_path):
    genfile = tmp_path / "unconditional_samples.json"
    _run(
        ROOT / "tools" / "generate_samples_gpt2.py",
        "--load", checkpoint, *TOKENIZER, *SHAPES.split(), "--fp16", "--batch-size", "2",
        "--seq-length", "64", "--out-seq-length", "8", "--temperature", "1.0",
        "--genfile", genfile, "--num-samples", "3", "--top_p", "0.9", "--recompute",
    )  # fmt: skip
    records = [json.loads(line) for line in genfile.read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert list(r) == ["text", "length", "finished"] and 1 <= r["length"] <= 8
        assert r["finished"] or r["length"] == 8


@pytest.mark.slow  # over a second on 2 cores
def test_unconditional_recompute_file_and_interactive_modes_match_the_library(
    checkpoint,
    loaded,
    data,
    tmp_path,
    monkeypatch,
    capsys,
):
    rt, engine, tok = loaded
    greedy = SamplingParams(6, greedy=True)
    lib = list(unconditional_samples(engine, tok, 2, 2, greedy))
    base = ["--load", checkpoint, "--out-seq-length", "6", *TOKENIZER, "--num-samples", "2"]
    for tool_argv, v1 in (
        (["--greedy", "--recompute", "--batch-size", "2", "--genfile", tmp_path / "a.json"], True),
        (["--genfile", tmp_path / "b.json", "--top_k", "1", "--temperature", "0.5"], False),
    ):
        argv = [*base, *tool_argv]
        assert generate_cli.main(list(map(str, argv)), v1=v1) == 0
    for name in ("a.json", "b.json"):  # --recompute (no KV cache) == the cache; top_k 1 = greedy
        assert [json.loads(x) for x in (tmp_path / name).read_text().splitlines()] == lib
    # Prompts from a file: Megatron's text blocks in <input>.out, the library's continuations.
    gen = ["--load", checkpoint, "--greedy", "--out-seq-length", "6", *TOKENIZER]
    prompts = str(data / "prompts.txt")
    assert generate_cli.main([*gen, "--sample-input-file", prompts], v1=True) == 0
    texts = [r["text"] for r in _complete(engine, tok, ["def main(", "The quick brown fox"])]
    expected = "".join(f"\nContext:{p}\n\nMegatron-LM:{t}\n" for p, t in zip(
        ["def main(", "The quick brown fox"], texts, strict=True))  # fmt: skip
    assert Path(prompts + ".out").read_text() == expected
    # Interactive: a prompt, an empty line (unconditional), then stop.
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("def main(\n\nstop\nnever read\n"))
    assert generate_cli.main(gen, v1=True) == 0
    out = capsys.readouterr().out
    uncond = _complete(engine, tok, [""])[0]["text"]
    assert f"Context:def main(\n\nMegatron-LM:{texts[0]}\n" in out
    assert f"Context:\n\nMegatron-LM:{uncond}\n" in out and out.count("Megatron-LM:") == 2


def _complete(engine, tok, texts):
    from megatron.inference.session import complete

    return complete(engine, tok, texts, SamplingParams(6, greedy=True))


@pytest.mark.slow  # over a second on 2 cores
def test_tasks_main_and_run_gpt2_eval_give_tools_evaluate_numbers(checkpoint, loaded, data, capsys):
    rt, engine, tok = loaded
    wiki = evaluate_wikitext(engine, tok, WIKI, 32, 16, 8)
    loose = evaluate_loose_json(engine, tok, LAMBADA, 16, 16, 2, max_batches=1)
    one, padded = (evaluate_lambada(engine, tok, LAMBADA, True, batch_size=b) for b in (1, 3))
    assert padded["accuracy"] == one["accuracy"]  # right padding never reaches a target
    assert padded["ppl"] == pytest.approx(one["ppl"], rel=1e-6)
    v1 = ["--load", checkpoint, *TOKENIZER, *SHAPES.split(), "--model-parallel-size", "1"]
    v1 += ["--checkpoint-activations", "--log-interval", "10", "--no-load-optim", "--no-load-rng"]
    v1 += ["--distributed-backend", "gloo", "--batch-size", "3", "--seq-length", "32"]

    def last_json(code: int) -> dict:
        assert code == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    wiki_args = ["--valid-data", str(data / "wiki.tokens"), "--overlapping-eval", "16"]
    got = last_json(evaluate_cli.tasks_main(["--task", "WIKITEXT103", *wiki_args, *v1]))
    ours = ["--task", "wikitext", "--load", checkpoint, "--seq-length", "32", "--batch-size", "3"]
    ours += ["--tensor-model-parallel-size", "1", "--distributed-backend", "gloo", *wiki_args]
    assert got == last_json(evaluate_cli.main(ours))  # tools/evaluate.py
    assert got["ppl"] == pytest.approx(wiki["ppl"], rel=1e-6)
    assert got["adjusted_ppl"] == pytest.approx(wiki["adjusted_ppl"], rel=1e-6)
    eval_2019 = ["--model-path", checkpoint, "--batch-size", "2", "--seq-length", "16"]
    eval_2019 += ["--model-parallel-size", "1", *SHAPES.split()[:6]]
    loose_args = ["--data-path", str(data / "lambada.jsonl"), "--overlapping-eval", "16"]
    loose_args += ["--webtext-eval", "--eval-iters", "1", "--cache-dir", str(MMAP)]
    got = last_json(evaluate_cli.gpt2_eval_main([*eval_2019, *loose_args]))
    assert got["ppl"] == pytest.approx(loose["ppl"], rel=1e-6)
    assert got["num_scored"] == loose["num_scored"] == 2 * 16


@pytest.mark.slow
def test_v1_commands_under_torch_distributed_launch_on_tp2(checkpoint, loaded, data):
    """evaluate_zeroshot_gpt2.sh and generate_text.sh scaled down on 2 processes (TP2), and the
    2019 --cloze-eval."""
    rt, engine, tok = loaded
    lam = evaluate_lambada(engine, tok, LAMBADA, strict=True)
    tp2 = data / "tp2"
    _run(ROOT / "tools" / "convert_checkpoint.py", "--load", checkpoint, "--save", tp2,
         "--target-tensor-model-parallel-size", "2")  # fmt: skip
    out = _run(
        "-m", "torch.distributed.launch", "--nproc_per_node", "2",
        "--master_port", str(free_port()), ROOT / "tasks" / "main.py",
        "--task", "LAMBADA", "--valid-data", data / "lambada.jsonl", "--strict-lambada",
        *TOKENIZER, "--load", tp2, "--model-parallel-size", "2", *SHAPES.split(),
        "--batch-size", "2", "--checkpoint-activations", "--seq-length", "64", "--log-interval",
        "10", "--no-load-optim", "--no-load-rng", "--distributed-backend", "gloo",
    ).stdout  # fmt: skip
    assert "validation results on LAMBADA | number correct:" in out
    genfile = data / "tp2_samples.json"
    _run(
        "-m", "torch.distributed.launch", "--nproc_per_node", "2",
        "--master_port", str(free_port()), ROOT / "tools" / "generate_samples_gpt2.py",
        "--load", tp2, "--model-parallel-size", "2", "--distributed-backend", "gloo",
        "--greedy", "--out-seq-length", "6", "--num-samples", "2", "--genfile", genfile,
    )  # fmt: skip
    greedy = list(unconditional_samples(engine, tok, 2, 1, SamplingParams(6, greedy=True)))
    assert [json.loads(line) for line in genfile.read_text().splitlines()] == greedy
    result = json.loads(out.strip().splitlines()[-1])
    assert result["accuracy"] == lam["accuracy"]
    assert result["ppl"] == pytest.approx(lam["ppl"], rel=1e-5)
    out = _run(
        ROOT / "scripts" / "run_gpt2_eval.py", "--model-path", checkpoint,
        "--data-path", data / "lambada.jsonl", "--cloze-eval", "--strict-lambada",
        "--batch-size", "16", "--cache-dir", MMAP, "--num-layers", "2",
    ).stdout  # fmt: skip
    assert json.loads(out.strip().splitlines()[-1])["ppl"] == pytest.approx(lam["ppl"], rel=1e-6)


@pytest.mark.slow  # over a second on 2 cores
def test_flags_must_agree_with_the_checkpoint_and_process_count(checkpoint, data, capsys):
    base = ["--task", "LAMBADA", "--valid-data", str(data / "lambada.jsonl"), "--load", checkpoint]
    for extra, named in (
        (["--num-layers", "3"], "--num-layers 3: the checkpoint"),
        (["--hidden-size", "64"], "--hidden-size 64"),
        (["--max-position-embeddings", "128"], "--max-position-embeddings 128"),
        (["--swiglu"], "--swiglu: the checkpoint"),
        (["--model-parallel-size", "2"], "--tensor-model-parallel-size 2 x"),
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2 does not"),
        (["--lr", "0.1"], "--lr: a training setting"),
        (["--fp16", "--bf16"], "--fp16/--bf16"),
        (["--valid-data", "a", "b"], "--valid-data: give exactly one file"),
        (["--epochs", "3"], "--epochs: only zero-shot"),
    ):
        assert evaluate_cli.tasks_main([*base, *extra]) == 1, extra
        assert named in capsys.readouterr().err, extra
    cache = ["--model-path", checkpoint, "--data-path", "x", "--cache-dir", str(data)]
    assert evaluate_cli.gpt2_eval_main(cache) == 1
    assert "--cache-dir" in capsys.readouterr().err
    gen = ["--load", checkpoint, "--genfile", "x.json"]
    assert generate_cli.main(gen, v1=True) == 1
    assert "--genfile is written by unconditional sampling" in capsys.readouterr().err
    assert generate_cli.main(["--load", checkpoint, "--num-samples", "2"], v1=True) == 1
    assert "--num-samples needs --genfile" in capsys.readouterr().err
    missing = ["--load", checkpoint, "--sample-input-file", str(data / "missing.txt")]
    assert generate_cli.main(missing, v1=True) == 1
    assert "--sample-input-file: [Errno 2]" in capsys.readouterr().err


def test_fp16_runs_on_cpu_and_stays_close_to_fp32(checkpoint, loaded):
    _, engine32, tok = loaded
    rt, engine16, _, _ = setup(checkpoint, given={"precision.fp16": True})
    try:
        assert engine16.dtype == torch.float16 and engine16.device.type == "cpu"
        ids = torch.tensor([tok.tokenize(LAMBADA[0])])
        l16, _ = engine16.token_losses(ids[:, :-1], ids[:, 1:])
        l32, _ = engine32.token_losses(ids[:, :-1], ids[:, 1:])
        torch.testing.assert_close(l16, l32, rtol=2e-2, atol=2e-2)
        assert len(generate(engine16, [ids[0].tolist()], SamplingParams(4, greedy=True))[0]) > 4
    finally:
        shutdown_distributed()


# --- unconditional / interactive generation on TP2 and PP2 (one spawn) ----------------------

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=8192,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
PARAMS = SamplingParams(5, top_k=4, seed=3)


def _modes(engine, rank: int = 0) -> dict:
    """Unconditional samples (3, two per batch), and an interactive session: prompt, empty
    line, stop; what rank 0 shows."""
    tok = _tok()
    shown = []
    lines = iter(["def main(", "", "stop"])
    rt = SimpleNamespace(state=engine.state, device=engine.device)
    n = interactive(rt, engine, tok, PARAMS, read=lambda _: next(lines), write=shown.append)
    return {
        "unconditional": list(unconditional_samples(engine, tok, 3, 2, PARAMS)),
        "recompute": list(unconditional_samples(engine, tok, 2, 2, PARAMS, use_cache=False)),
        "interactive": (n, shown if rank == 0 else None),
    }


def _modes_worker(rank, world):
    out = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        state = initialize_model_parallel(tp, pp)
        chunks = build_model(CFG, BuildContext(state, seed=4))
        out[name] = _modes(InferenceModel(chunks, state, CFG.vocab_size, CFG.hidden_size), rank)
        destroy_model_parallel(state)
    return out


def test_unconditional_and_interactive_on_tp2_and_pp2_match_one_process():
    state = mpu.single_process_state()
    chunks = build_model(CFG, BuildContext(state, seed=4))
    expected = _modes(InferenceModel(chunks, state, CFG.vocab_size, CFG.hidden_size))
    assert expected["interactive"][0] == 2 and len(expected["unconditional"]) == 3
    assert expected["recompute"] == expected["unconditional"][:2]
    assert "Context:\n\nMegatron-LM:" in expected["interactive"][1][1]
    for rank, out in enumerate(run_distributed(_modes_worker, 2)):
        for name in ("tp2", "pp2"):
            got = out[name]
            assert got["unconditional"] == expected["unconditional"], (rank, name)
            assert got["recompute"] == expected["recompute"], (rank, name)
            if rank == 0:
                assert got["interactive"] == expected["interactive"], name
            else:
                assert got["interactive"][0] == 2, name
