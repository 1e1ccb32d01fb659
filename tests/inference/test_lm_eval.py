"""lm-evaluation-harness: our model "megatron" (tools/lm_eval.py) on a PP = 2 checkpoint gets
the same multiple-choice accuracy and log-likelihoods as lm-eval's hf model on the HF export,
the same rolling log-likelihood, and runs generate_until; with rolling=megatron its perplexity
equals tools/evaluate.py's; lm-eval's local-completions model through our server's
/v1/completions, with the model_args docs/inference.md gives, scores and generates like them.
The model leans to end-of-document (serving.lean_to_eod): the greedy next token after most
choices is end-of-document, which the server must return as a token (lm-eval drops the last
token of each answer as the generated one). Fully offline: local task YAMLs over local JSONL
files."""

import glob
import json
import math
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.paths import ROOT
from tests.helpers.serving import (
    Server,
    convert,
    fixture_tokenizer,
    lean_to_eod,
    make_checkpoint,
    rank_env,
)

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate ('.[eval]')")

QUESTIONS = [
    ("The quick brown", ["fox", "dog", "class", "return"], 0),
    ("def add(a, b):", [" return a + b", " pass", " yield", " import os"], 0),
    ("Pipeline parallelism splits the", [" layers", " data", " tokens"], 0),
    ("import", [" os", " sys", " numpy", " torch"], 1),
    ("class Node:", [" pass", "\n    def", " value"], 1),
    ("for i in", [" range(10):", " items:", " x"], 0),
]
# Longer than one 64-token window, so the rolling windows are exercised.
TEXTS = [
    "Pipeline parallelism splits the layers of a model across devices; tensor parallelism "
    "splits each layer. Data parallelism copies the model and splits the batch. Together "
    "they make 3D parallelism, which trains models that fit on no single device, and the "
    "schedule decides how the micro batches flow through the stages of the pipeline.",
    "The quick brown fox jumps over the lazy dog and the lazy dog sleeps on",
]


def _task_dir(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    with open(tasks / "mc.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(tasks / "ppl.jsonl", "w") as f:
        for text in TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    data = "dataset_kwargs:\n  data_files:\n    test: {}\n"
    (tasks / "mc.yaml").write_text(
        f"task: local_mc\n{common}{data.format(tasks / 'mc.jsonl')}"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    (tasks / "ppl.yaml").write_text(
        f"task: local_ppl\n{common}{data.format(tasks / 'ppl.jsonl')}"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    (tasks / "gen.yaml").write_text(
        f"task: local_gen\n{common}{data.format(tasks / 'mc.jsonl')}"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return tasks


def _env(root: Path) -> dict:
    return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf")}


def _run(cmd: list[str], root: Path, world: int = 1, timeout: int = 180) -> None:
    master = free_port()
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**rank_env(r, world, master), **_env(root)},
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    with open(path) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def _results(out: Path) -> dict:
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        return json.load(f)["results"]


def _lm_eval(model: str, model_args: str, tasks: str, task_dir: Path, out: Path) -> list[str]:
    return [
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        tasks,
        "--include_path",
        str(task_dir),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "4",
        "--device",
        "cpu",
    ]


def _documented_model_args(url: str, hf: Path) -> str:
    """The model_args of docs/inference.md's local-completions command, pointed at this test's
    server and HF export, with this model's context (63: one token past each window of 64)."""
    doc = (ROOT / "docs" / "inference.md").read_text()
    found = re.search(r"lm_eval --model local-completions --model_args (\S+?)`", doc)
    assert found, "docs/inference.md lost its lm-eval local-completions command"
    args = dict(kv.split("=", 1) for kv in found.group(1).split(","))
    assert set(args) == {"base_url", "model", "tokenizer", "tokenizer_backend", "max_length"}
    args["base_url"] = args["base_url"].replace("http://127.0.0.1:5000", url)
    args.update(tokenizer=str(hf), max_length="63")
    return ",".join(f"{k}={v}" for k, v in args.items())


def _ends_of_document(url: str) -> int:
    """How many QUESTIONS' texts the model ends with end-of-document, asked as lm-eval asks for
    a log-likelihood (ids, echo, logprobs, one greedy token; "model": null, as lm-eval sends
    without model=): every answer holds the prompt and one generated token."""
    tok = fixture_tokenizer()
    prompts = [tok.tokenize(q) + tok.tokenize(c) for q, choices, _ in QUESTIONS for c in choices]
    body = {"model": None, "prompt": prompts, "max_tokens": 1, "temperature": 0}
    body.update(echo=True, logprobs=1, seed=1)
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.load(response)
    assert answer["model"] == "megatron"  # the served model
    assert answer["usage"]["completion_tokens"] == len(prompts)
    ended = 0
    for c, ids in zip(answer["choices"], prompts, strict=True):
        assert len(c["logprobs"]["token_logprobs"]) == len(ids) + 1
        if c["finish_reason"] == "stop":
            assert c["logprobs"]["tokens"][-1] == "<|endoftext|>"
            assert c["text"] == tok.detokenize(ids)  # the end of document is not text
            ended += 1
    return ended


@pytest.mark.slow
def test_megatron_model_matches_the_hf_export_and_evaluate_py(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", edit=lean_to_eod)
    pp2, hf = tmp_path / "pp2", tmp_path / "hf_model"
    convert(["--load", ckpt, "--save", str(pp2), "--target-pipeline-model-parallel-size", "2"])
    convert(["--load", ckpt, "--to-hf", str(hf)])
    tasks = _task_dir(tmp_path)
    tool = [sys.executable, str(ROOT / "tools" / "lm_eval.py")]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    args = f"load={pp2},pipeline_model_parallel_size=2"
    _run(
        tool + _lm_eval("megatron", args, "local_mc,local_ppl,local_gen", tasks, ours), tmp_path, 2
    )
    hf_cmd = [sys.executable, "-m", "lm_eval"]
    _run(hf_cmd + _lm_eval("hf", f"pretrained={hf}", "local_mc,local_ppl", tasks, theirs), tmp_path)

    assert _results(ours)["local_mc"]["acc,none"] == _results(theirs)["local_mc"]["acc,none"]
    for task in ("local_mc", "local_ppl"):
        for a, b in zip(_samples(ours, task), _samples(theirs, task), strict=True):
            for x, y in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
                x, y = (x, y) if isinstance(x, list) else ([x], [y])
                assert math.isclose(float(x[0]), float(y[0]), rel_tol=1e-4, abs_tol=1e-4), task
                assert x[1:] == y[1:] or str(x[1:]) == str(y[1:]), (task, x, y)
    gen = _samples(ours, "local_gen")
    assert len(gen) == len(QUESTIONS) and all(isinstance(s["resps"][0][0], str) for s in gen)

    # lm-eval's local-completions model against our server's /v1/completions (as with vLLM),
    # run as docs/inference.md says: the same log-likelihoods and accuracy as the hf model
    # (most answers end the document), the same greedy generations as the in-process model.
    server = Server(ckpt)
    try:
        assert _ends_of_document(server.url) >= len(QUESTIONS)
        api_args = _documented_model_args(server.url, hf)
        api = tmp_path / "api"
        _run(
            hf_cmd + _lm_eval("local-completions", api_args, "local_mc,local_gen", tasks, api),
            tmp_path,
        )
    finally:
        assert server.stop() == [0]
    assert _results(api)["local_mc"]["acc,none"] == _results(theirs)["local_mc"]["acc,none"]
    for a, b in zip(_samples(api, "local_mc"), _samples(theirs, "local_mc"), strict=True):
        for x, y in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            assert math.isclose(float(x[0]), float(y[0]), rel_tol=1e-4, abs_tol=1e-4)
            assert str(x[1]) == str(y[1])
    api_gen = [s["filtered_resps"] for s in _samples(api, "local_gen")]
    assert api_gen == [s["filtered_resps"] for s in gen]

    # rolling=megatron is tools/evaluate.py's scheme: the same perplexity on the same text.
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXTS[0])
    evaluate = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "evaluate.py"), "--task", "wikitext"]
        + ["--valid-data", str(text_file), "--load", ckpt, "--overlapping-eval", "16"]
        + ["--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert evaluate.returncode == 0, evaluate.stderr
    expected = json.loads(evaluate.stdout.strip().splitlines()[-1])
    mega = tmp_path / "mega"
    args = f"load={ckpt},rolling=megatron,overlapping_eval=16"
    _run(tool + _lm_eval("megatron", args, "local_ppl", tasks, mega), tmp_path)
    loglik = float(_samples(mega, "local_ppl")[0]["filtered_resps"][0])
    assert math.isclose(-loglik / (expected["num_tokens"] - 1), expected["loss"], rel_tol=1e-5)
