"""examples/pretrain_gpt2_3d.sh runs as the README writes it: SMOKE=1 needs no data or vocab
paths (it writes a small corpus) and trains a few iterations, not 300,000."""

import os
import subprocess
import sys

from tests.helpers.paths import ROOT


def _stub_python(tmp_path):
    """A python that runs everything but the launcher, whose arguments it prints instead."""
    stub = tmp_path / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then echo "LAUNCH $*"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)
    return str(stub)


def test_3d_script_smoke_builds_its_own_data_and_runs_few_iterations(tmp_path):
    env = {**os.environ, "SMOKE": "1", "PYTHON": _stub_python(tmp_path)}
    script = str(ROOT / "examples" / "pretrain_gpt2_3d.sh")
    run = subprocess.run(
        ["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    launch = next(line for line in run.stdout.splitlines() if line.startswith("LAUNCH "))
    args = launch.split()
    assert args[args.index("--train-iters") + 1] == "20"
    assert args[args.index("--data-path") + 1] == "smoke_out/corpus_text_document"
    assert "--vocab-file" not in args and "--distributed-backend" in args
    assert (tmp_path / "smoke_out" / "corpus_text_document.idx").is_file()
    # Without SMOKE the data is the user's: a missing DATA is one line saying what to pass.
    env.pop("SMOKE")
    bad = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "pass DATA=PREFIX" in bad.stderr, bad.stderr


def test_shakespeare_char_config_trains_on_a_text_file_as_its_header_says(tmp_path):
    """The nanoGPT route: a .txt, a character vocab, paragraphs as documents, the CPU config."""
    text = "".join(
        f"SPEAKER {i % 7}:\nA line of verse, number {i}.\nAnd one more.\n\n" for i in range(300)
    )
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    data = tmp_path / "data" / "shakespeare_char"
    py, tools = sys.executable, ROOT / "tools"
    steps = [
        [py, tools / "train_tokenizer.py", "--input", "input.txt", "--type", "char-level"]
        + ["--output-dir", data],
        [py, tools / "preprocess_data.py", "--input", "input.txt", "--txt-documents"]
        + ["paragraph", "--append-eod", "--tokenizer-type", "CharTokenizer", "--vocab-file"]
        + [data / "vocab.json", "--output-prefix", data / "input"],
        [py, ROOT / "pretrain_gpt2.py", "-c", ROOT / "examples/configs/shakespeare_char_cpu.yaml"]
        + ["--train-iters", "4", "--lr-warmup-iters", "1", "--eval-interval", "4"]
        + ["--eval-iters", "1", "--log-interval", "2"],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in steps:
        run = subprocess.run(
            list(map(str, argv)), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
    assert " number of parameters: 0.8" in run.stdout, run.stdout  # about 0.8M
    assert "validation loss at iteration 4" in run.stdout
    assert (
        tmp_path / "checkpoints" / "shakespeare_char" / "latest_checkpointed_iteration.txt"
    ).is_file()


def test_fault_tolerant_script_launches_one_torchrun_per_replica_group(tmp_path):
    """examples/pretrain_gpt2_fault_tolerant.sh: a torchrun per group, each with its own port,
    --max-restarts (a dead group comes back and rejoins from a peer) and --ft-replica-id."""
    env = {**os.environ, "PYTHON": _stub_python(tmp_path), "DATA": "corpus_text_document"}
    env.update(REPLICA_GROUPS="2", FT_GROUP_SIZE="4", FIRST_GROUP="2", LIGHTHOUSE="http://h:1")
    script = str(ROOT / "examples" / "pretrain_gpt2_fault_tolerant.sh")
    run = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    launches = [line.split() for line in run.stdout.splitlines() if line.startswith("LAUNCH ")]
    assert sorted(a[a.index("--ft-replica-id") + 1] for a in launches) == ["2", "3"]
    assert len({a[a.index("--master_port") + 1] for a in launches}) == 2
    for args in launches:
        assert args[args.index("--ft-group-size") + 1] == "4"
        assert args[args.index("--ft-lighthouse") + 1] == "http://h:1"
        assert "--max-restarts" in args and "--fault-tolerance" in args


def test_fault_tolerant_script_smoke_mode_runs_on_the_cpu_with_its_own_lighthouse(tmp_path):
    """SMOKE=1: three 1-rank gloo groups of a tiny model, GPT-2's shipped tokenizer (no vocab
    files to find), a lighthouse of its own bound to 127.0.0.1 (not every interface) and
    torchft's per-quorum INFO lines off."""
    from tests.helpers.training import counting_corpus

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lighthouse = bin_dir / "torchft_lighthouse"  # records its arguments, then serves "forever"
    lh_args = tmp_path / "lh_args"  # RUST_LOG as the lighthouse (and the groups) see it, then
    lighthouse.write_text(f'#!/usr/bin/env bash\necho "$RUST_LOG $*" > {lh_args}\nsleep 30\n')
    lighthouse.chmod(0o755)
    python = _stub_python(tmp_path)  # whose launches wait (10 s at most) for the lighthouse
    text = (
        open(python)
        .read()
        .replace(
            'echo "LAUNCH',
            f'for _ in $(seq 100); do [ -s {lh_args} ] && break; sleep 0.1; done; echo "LAUNCH',
        )
    )
    open(python, "w").write(text)
    env = {**os.environ, "SMOKE": "1", "PYTHON": python}
    env.update(DATA=counting_corpus(tmp_path), PATH=f"{bin_dir}:{os.environ['PATH']}")
    env.pop("RUST_LOG", None)
    script = str(ROOT / "examples" / "pretrain_gpt2_fault_tolerant.sh")
    run = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    launches = [line.split() for line in run.stdout.splitlines() if line.startswith("LAUNCH ")]
    assert sorted(a[a.index("--ft-replica-id") + 1] for a in launches) == ["0", "1", "2"]
    recorded = lh_args.read_text().split()
    assert recorded[0] == "warn" and recorded[-2:] == ["--bind", "127.0.0.1:29510"]
    for args in launches:
        assert args[args.index("--ft-lighthouse") + 1] == "http://127.0.0.1:29510"
        assert args[args.index("--distributed-backend") + 1] == "gloo"
        assert args[args.index("--tokenizer-type") + 1] == "GPT2BPETokenizer"
        assert "--vocab-file" not in args and "--bf16" not in args


def test_deepseek_v3_proxy_config_trains_two_steps(tmp_path):
    """The DeepSeek-V3 proxy run file (MLA, MTP, the expert-bias sigmoid router with groups, a
    dense first layer) trains 2 steps on a toy corpus, its MTP and router statistics logged."""
    from tests.helpers.training import counting_corpus

    data = counting_corpus(tmp_path)
    config = ROOT / "examples/configs/deepseek_v3_proxy.yaml"
    ids = ["-o", "data.tokenizer.tokenizer_type=null", "-o", "data.tokenizer.vocab_file=null"]
    ids += ["-o", "data.tokenizer.merge_file=null", "--vocab-size", "128"]  # the corpus's ids
    short = ["--train-iters", "2", "--lr-warmup-iters", "1", "--log-interval", "1"]
    short += ["--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "1"]
    argv = [sys.executable, ROOT / "pretrain_gpt2.py", "-c", config, "--data-path", data]
    argv += [*ids, *short, "--save", tmp_path / "ckpt", "--tensorboard-dir", tmp_path / "tb"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        list(map(str, argv)), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 2 and all("mtp_1 loss:" in line for line in lines), run.stdout
    assert "expert load max/mean" in lines[-1]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
