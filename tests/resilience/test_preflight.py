"""Start-up checks of megatron/resilience/preflight.py that depend on the device: --deepspeed with
a precision DeepSpeed's accelerator lacks is a named error before any work."""

import json
import subprocess
import sys

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.resilience import preflight
from tests.helpers.paths import MMAP, ROOT
from tests.helpers.training import BASE

TRAIN = [*BASE, "--train-iters", "2", "--lr", "1e-3", "--global-batch-size", "4"]


def _only(*names):
    """A device that supports exactly `names`, recording what was asked."""
    asked = []

    def supported(name: str) -> bool:
        asked.append(name)
        return name in names

    supported.asked = asked
    return supported


def test_fp16_with_deepspeed_where_deepspeed_lacks_fp16_names_the_fix():
    cfg = parse_args([*TRAIN, "--fp16", "--deepspeed"], world_size=1)
    with pytest.raises(ConfigError) as e:
        preflight.check_deepspeed_precision(cfg, _only("bf16"))
    message = str(e.value)
    assert message.startswith("--fp16 with --deepspeed: DeepSpeed's engine does not support fp16")
    assert "Fix: pass --bf16 instead of --fp16, or drop --deepspeed" in message
    bf16 = parse_args([*TRAIN, "--bf16", "--deepspeed"], world_size=1)
    preflight.check_deepspeed_precision(bf16, _only("bf16"))  # the fix passes
    with pytest.raises(ConfigError, match="Fix: pass --fp16 instead of --bf16"):
        preflight.check_deepspeed_precision(bf16, _only("fp16"))  # e.g. a pre-Ampere GPU


def test_fp16_from_the_deepspeed_json_names_the_file_and_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 0}}))
    cfg = parse_args([*TRAIN, "--fp16", "--deepspeed", "--deepspeed_config", str(path)], 1)
    with pytest.raises(ConfigError) as e:
        preflight.check_deepspeed_precision(cfg, _only("bf16"))
    assert f'--deepspeed_config {path}, "fp16": {{"enabled": false}}' in str(e.value)


def test_the_device_is_asked_only_for_a_deepspeed_run_in_half_precision():
    for extra in (["--fp16"], ["--deepspeed"], ["--deepspeed", "--fp16"]):
        supported = _only("fp16", "bf16")
        preflight.check_deepspeed_precision(parse_args([*TRAIN, *extra], world_size=1), supported)
        assert supported.asked == (["fp16"] if len(extra) == 2 else [])


def test_the_device_answer_mirrors_deepspeeds_accelerator(monkeypatch):
    import torch

    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        get_accelerator = None
    if get_accelerator is not None:
        accelerator = get_accelerator()
        for name in ("fp16", "bf16"):
            expected = bool(getattr(accelerator, f"is_{name}_supported")())
            assert preflight.deepspeed_dtype_supported(name) is expected
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator", None)  # DeepSpeed not installed
    assert preflight.deepspeed_dtype_supported("fp16") is torch.cuda.is_available()


def test_pretrain_gpt2_refuses_fp16_with_deepspeed_before_start_up(tmp_path):
    pytest.importorskip("deepspeed")
    if preflight.deepspeed_dtype_supported("fp16"):
        pytest.skip("DeepSpeed supports fp16 on this device")
    data = str(MMAP / "megatron_text_document")
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(MMAP / "vocab.json")]
    tokenizer += ["--merge-file", str(MMAP / "merges.txt")]
    argv = [*TRAIN, "--micro-batch-size", "2", "--data-path", data, *tokenizer]
    done = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt2.py"), *argv, "--fp16", "--deepspeed"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --fp16 with --deepspeed: DeepSpeed's engine does not support")
    assert "fused kernels" not in done.stdout  # stopped before the model was built


def test_a_mistyped_load_directory_is_refused_unless_load_and_save_are_one(tmp_path, capsys):
    """--load naming no directory would train from scratch and exit 0: refused, with the close
    name beside it; --load X --save X (Megatron's first-run idiom) starts fresh, saying so once."""
    from types import SimpleNamespace

    from megatron.checkpoint.storage import CheckpointError
    from megatron.training.state import resume

    (tmp_path / "run-a").mkdir()
    typo = str(tmp_path / "run-b")
    with pytest.raises(CheckpointError) as err:
        preflight.check_load_dir(typo, str(tmp_path / "new"))
    msg = str(err.value)
    assert msg.startswith(f"--load {typo}: no such directory") and "--load and --save" in msg
    assert f"did you mean {tmp_path / 'run-a'}?" in msg
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        preflight.check_load_dir(str(tmp_path / "file"), None)
    fresh = str(tmp_path / "fresh")
    preflight.check_load_dir(fresh, fresh + "/")  # the idiom: no error
    rt = SimpleNamespace(state=SimpleNamespace(rank=0))
    for save, said in ((fresh, ""), (str(tmp_path / "other"), "warning: --load: ")):
        cfg = parse_args([*TRAIN, "--load", fresh, "--save", save], world_size=1)
        assert resume(cfg, rt, read=None, restore=None).iteration == 0
        assert capsys.readouterr().err == f"{said}no checkpoint in {fresh}: starting from scratch\n"


@pytest.fixture
def before_start_up(monkeypatch):
    """pretrain() as far as start-up: a check that has not raised by then comes too late."""
    from megatron.training import loop

    def start_up(cfg):
        raise AssertionError("the process groups (and then the model) came before the check")

    monkeypatch.setattr(loop, "initialize_megatron", start_up)
    return lambda argv: loop.pretrain(parse_args([*TRAIN, "--micro-batch-size", "2", *argv], 1))


def test_a_mistyped_data_path_is_named_before_start_up(before_start_up):
    """It was found by the dataset builder after the model and process groups (80 s in)."""
    typo = str(MMAP / "megatron_text_documnet")
    with pytest.raises(FileNotFoundError) as err:
        before_start_up(["--data-path", typo])
    assert str(err.value).startswith(f"{typo}.idx: index file not found (did you mean ")
    assert f"{MMAP / 'megatron_text_document'}? is the --data-path prefix right?" in str(err.value)
    from tests.helpers.data import TOK

    train = str(MMAP / "megatron_text_document")
    with pytest.raises(FileNotFoundError, match="index file not found"):  # any split's path
        before_start_up(["--train-data-path", train, "--valid-data-path", typo, *TOK])


def test_data_made_with_another_tokenizer_is_named_before_start_up(tmp_path, before_start_up):
    from megatron.data.gpt_dataset import DataError
    from tests.helpers.data import TOK, _run

    assert _run(tmp_path, [MMAP / "corpus.jsonl"]) == 0  # with its PREFIX.idx.json
    vocab = json.loads((MMAP / "vocab.json").read_text())
    a, b = (t for t, i in vocab.items() if i in (0, 1))  # same size, other ids for the text
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "swapped.json").write_text(json.dumps(vocab))
    swapped = [*TOK[:3], str(tmp_path / "swapped.json"), *TOK[4:]]
    prefix = str(tmp_path / "out_text_document")
    with pytest.raises(DataError, match="made with another tokenizer than this run's"):
        before_start_up(["--data-path", prefix, *swapped])
    with pytest.raises(DataError, match="outside the model's vocab"):  # ids as ids: --vocab-size
        before_start_up(["--data-path", prefix])
    with pytest.raises(AssertionError, match="came before the check"):  # the right one passes
        before_start_up(["--data-path", prefix, *TOK])
