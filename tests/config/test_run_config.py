"""Run configs: -c FILE and -o overrides resolve like the flags (defaults < file < flags < -o),
unknown keys fail with a suggestion, --print-config re-loads to the same config, and every
shipped example resolves."""

import itertools
import json
import subprocess
import sys

import pytest
import yaml

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.files import to_yaml
from megatron.config.rules import validate
from megatron.config.schema import MegatronConfig
from tests.helpers.paths import ROOT

EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))

FLAGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--vocab-size",
    "1000",
    "--tensor-model-parallel-size",
    "2",
    "--checkpoint-activations",
    "--no-masked-softmax-fusion",
    "--disable-bias-linear",
    "--rampup-batch-size",
    "4",
    "4",
    "100",
    "--global-batch-size",
    "8",
    "--train-samples",
    "1000",
    "--lr",
    "1e-4",
    "--data-path",
    "0.3",
    "a",
    "0.7",
    "b",
    "--tokenizer-type",
    "NullTokenizer",
    "--deepspeed",
    "--zero-stage",
    "1",
]
SAME_AS_YAML = {
    "model": {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "vocab_size": 1000,
        "add_bias_linear": False,
    },
    "parallel": {"tensor_model_parallel_size": 2},
    "recompute": {"granularity": "full"},
    "kernels": {"masked_softmax_fusion": False},
    "training": {"rampup_batch_size": [4, 4, 100], "global_batch_size": 8, "train_samples": 1000},
    "optimizer": {"lr": "1e-4"},  # YAML 1.1 reads 1e-4 as a string; the float type converts it
    "data": {"data_path": [0.3, "a", 0.7, "b"], "tokenizer": {"tokenizer_type": "NullTokenizer"}},
    "deepspeed": {"enabled": True, "zero_stage": 1},
}


def _write(tmp_path, data, name="run.yaml") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("name", ["run.yaml", "run.json"])
def test_flags_and_a_config_file_resolve_to_the_same_config(tmp_path, name):
    from_flags = parse_args(FLAGS, world_size=4)
    from_file = parse_args(["-c", _write(tmp_path, SAME_AS_YAML, name)], world_size=4)
    assert from_file == from_flags
    assert from_file.data.data_path == ("0.3", "a", "0.7", "b")
    assert from_file.training.rampup_batch_size == (4, 4, 100)


def test_flags_beat_the_file_and_o_beats_both(tmp_path):
    path = _write(tmp_path, SAME_AS_YAML)
    cfg = parse_args(["-c", path, "--hidden-size", "128"], world_size=4)
    assert cfg.model.hidden_size == 128 and cfg.model.num_layers == 4
    cfg = parse_args(
        ["-o", "model.hidden_size=256", "-c", path, "--hidden-size", "128"], world_size=4
    )
    assert cfg.model.hidden_size == 256, "-o wins wherever it stands on the command line"
    cfg = parse_args(
        [*FLAGS, "-o", "recompute.granularity=selective", "-o", "data.data_path=[c]"],
        world_size=4,
    )
    assert cfg.recompute.granularity == "selective" and cfg.data.data_path == ("c",)
    twice = parse_args(["-o", "model.num_layers=6", "-o", "model.num_layers=8"], world_size=1)
    assert twice.model.num_layers == 8


def test_a_flag_at_its_default_still_beats_the_file(tmp_path):
    # The parser knows which flags were typed, not just which differ from the default.
    path = _write(tmp_path, {"model": {"num_layers": 4}, "kernels": {"bias_gelu_fusion": False}})
    assert parse_args(["-c", path, "--num-layers", "2"], world_size=1).model.num_layers == 2
    assert not parse_args(["-c", path], world_size=1).kernels.bias_gelu_fusion


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"model": {"hiden_size": 3}},
            "unknown key 'model.hiden_size'. Fix: did you mean 'model.hidden_size'",
        ),
        ({"modle": {"hidden_size": 3}}, "unknown section 'modle'. Fix: did you mean 'model'"),
        (
            {"model": {"tensor_model_parallel_size": 2}},
            "did you mean 'parallel.tensor_model_parallel_size'",
        ),
        ({"data": {"tokenizr": {"vocab_file": "v"}}}, "did you mean 'data.tokenizer'"),
        ({"model": {"hidden_size": "abc"}}, "model.hidden_size = 'abc' is not an integer"),
        ({"model": 3}, "model must be a mapping"),
        ({"training": {"rampup_batch_size": [1, 2]}}, "takes 3 values"),
        ({"optimizer": {"lr_decay_style": "cosin"}}, "use one of constant, linear, cosine"),
        ({"parallel": {"world_size": 8}}, "parallel.world_size is not a config key"),
    ],
)
def test_bad_keys_and_values_in_a_file_fail_naming_them(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        parse_args(["-c", path], world_size=1)
    assert message in str(err.value) and path in str(err.value)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.num_layer=3", "did you mean 'model.num_layers'"),
        ("optimiser.lr=1", "unknown section 'optimiser'. Fix: did you mean 'optimizer'"),
        ("num_layers=3", "did you mean 'model.num_layers'"),
        ("model.swiglu=3", "model.swiglu = 3 is not true or false"),
        ("model.num_layers", "expected section.key=value"),
        ("model=3", "'model' is a section, not a key"),
    ],
)
def test_bad_overrides_fail_naming_them(override, message):
    with pytest.raises(ConfigError) as err:
        parse_args(["-o", override], world_size=1)
    assert message in str(err.value) and f"-o {override}" in str(err.value)


def test_unreadable_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_args(["-c", str(tmp_path / "missing.yaml")], world_size=1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [1\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_args(["-c", str(bad)], world_size=1)


def test_print_config_reloads_to_the_same_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        parse_args([*FLAGS, "--print-config"], world_size=4)
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "# parallel.world_size = 4" in printed
    assert yaml.safe_load(printed)["model"]["hidden_size"] == 64
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    assert parse_args(["-c", str(path)], world_size=4) == parse_args(FLAGS, world_size=4)


def test_defaults_round_trip_through_yaml(tmp_path):
    path = tmp_path / "defaults.yaml"
    path.write_text(to_yaml(MegatronConfig()))
    assert parse_args(["-c", str(path)], world_size=1) == MegatronConfig()


def test_pretrain_prints_the_config_before_any_distributed_or_data_work(tmp_path):
    # WORLD_SIZE=2 without a master address or a second process: any process-group init
    # would fail or hang; --print-config must exit first.
    example = str(ROOT / "examples" / "configs" / "gpt2_345m.yaml")
    out = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt2.py"), "-c", example, "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["model"]["num_layers"] == 24 and printed["recompute"]["granularity"] == "full"


WORLDS = {"gpt2_345m.yaml": 1, "gpt3_1.3b_dp.yaml": 8, "gpt3_6.7b_sharded.yaml": 16}
WORLDS["shakespeare_char_cpu.yaml"] = 1
WORLDS["shakespeare_gpt2_cpu.yaml"] = 1
WORLDS["deepseek_v3_proxy.yaml"] = 1


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_shipped_example_resolves(path):
    assert set(WORLDS) == {p.name for p in EXAMPLES}, "give each example the world it needs"
    cfg = parse_args(["-c", str(path)], world_size=WORLDS[path.name])
    validate(cfg, "train-gpt")
    lines = path.read_text().splitlines()
    header = "\n".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
    assert "pretrain_gpt2.py" in header and f"-c examples/configs/{path.name}" in header, (
        "each example's header comment gives its launch command"
    )
    m = cfg.model
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length)
    assert (
        shape
        == {
            "gpt2_345m.yaml": (24, 1024, 16, 1024),
            "gpt3_1.3b_dp.yaml": (24, 2048, 16, 1024),
            "gpt3_6.7b_sharded.yaml": (32, 4096, 32, 1024),
            "shakespeare_char_cpu.yaml": (4, 128, 4, 64),
            "shakespeare_gpt2_cpu.yaml": (4, 128, 4, 64),
            "deepseek_v3_proxy.yaml": (4, 128, 4, 128),
        }[path.name]
    )
    if cfg.deepspeed.enabled:
        from megatron.config.deepspeed_json import build_ds_config

        ds = build_ds_config(cfg)  # the JSON it names exists and agrees with the file
        assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 128


def test_override_values_are_yaml_converted_to_the_declared_type():
    cfg = parse_args(
        [
            "-o",
            "distributed.ddp_bucket_size=4e7",  # a whole number written as a float
            "-o",
            "optimizer.lr=1e-4",  # YAML 1.1 reads this as a string
            "-o",
            "data.split=100",
            "-o",
            "data.data_path=null",
            "-o",
            "model.ffn_hidden_size=null",
            "-o",
            "deepspeed.zero_reduce_scatter=false",
        ],
        world_size=1,
    )
    assert cfg.distributed.ddp_bucket_size == 40_000_000 and cfg.optimizer.lr == 1e-4
    assert cfg.data.split == "100" and cfg.data.data_path == ()
    assert cfg.model.ffn_hidden_size is None and cfg.deepspeed.zero_reduce_scatter is False
    with pytest.raises(ConfigError, match="model.num_layers = 2.5 is not an integer"):
        parse_args(["-o", "model.num_layers=2.5"], world_size=1)
    with pytest.raises(ConfigError, match="model.num_layers cannot be empty"):
        parse_args(["-o", "model.num_layers=null"], world_size=1)


def test_a_flag_changing_the_tokenizer_type_drops_the_run_files_tokenizer_files():
    """-c shakespeare_char_cpu.yaml --tokenizer-type GPT2BPETokenizer: GPT-2's own files, not
    the character vocab.json the file named (a kept vocab_file would build a char-sized BPE)."""
    char = ["-c", str(ROOT / "examples/configs/shakespeare_char_cpu.yaml")]
    kept = parse_args(char, world_size=1).data.tokenizer
    assert (kept.tokenizer_type, kept.vocab_file) == ("CharTokenizer", kept.vocab_file)
    assert kept.vocab_file.endswith("vocab.json")
    bpe = parse_args([*char, "--tokenizer-type", "GPT2BPETokenizer"], world_size=1).data.tokenizer
    assert (bpe.tokenizer_type, bpe.vocab_file, bpe.merge_file) == ("GPT2BPETokenizer", None, None)
    # files given again with the new type are kept; the same type keeps the file's files
    again = [*char, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"]
    again += ["--merge-file", "m.txt"]
    tok = parse_args(again, world_size=1).data.tokenizer
    assert (tok.vocab_file, tok.merge_file) == ("v.json", "m.txt")
    same = parse_args([*char, "--tokenizer-type", "CharTokenizer"], world_size=1).data.tokenizer
    assert same.vocab_file == kept.vocab_file
    # and an explicit unset
    unset = parse_args([*char, "-o", "data.tokenizer.vocab_file=null"], world_size=1)
    assert unset.data.tokenizer.vocab_file is None
