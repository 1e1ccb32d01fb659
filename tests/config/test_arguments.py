"""Flags parse into the config tree; every validation rule fails fast naming its flag."""

import re

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema import ModelConfig
from tests.helpers.paths import FIXTURES, ROOT
from tests.helpers.training import BASE


def test_defaults_are_gpt2_style():
    cfg = parse_args(BASE, world_size=1)
    m = cfg.model
    assert (m.position_embedding_type, m.normalization, m.swiglu) == ("learned", "LayerNorm", False)
    assert not m.untie_embeddings_and_output_weights and m.add_bias_linear
    assert m.ffn_size == 256 and m.max_positions == 32 and m.query_groups == 8
    assert cfg.precision.params_dtype == torch.float32
    assert cfg.parallel.data_parallel_size == 1


def test_classic_and_current_spellings_are_one_flag():
    a = parse_args([*BASE, "--model-parallel-size", "2", "--batch-size", "3"], world_size=4)
    b = parse_args(
        [*BASE, "--tensor-model-parallel-size", "2", "--micro-batch-size", "3"], world_size=4
    )
    assert a == b
    assert a.parallel.tensor_model_parallel_size == 2 and a.training.micro_batch_size == 3
    assert a.parallel.data_parallel_size == 2


def test_full_flag_set_parses():
    cfg = parse_args(
        [
            *BASE,
            "--ffn-hidden-size",
            "96",
            "--num-query-groups",
            "2",
            "--max-position-embeddings",
            "64",
            "--make-vocab-size-divisible-by",
            "64",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0.2",
            "--init-method-std",
            "0.01",
            "--position-embedding-type",
            "rope",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--untie-embeddings-and-output-weights",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--distributed-backend",
            "gloo",
            "--distributed-timeout-minutes",
            "3",
            "--seed",
            "7",
            "--bf16",
            "--global-batch-size",
            "8",
        ],
        world_size=4,
    )
    m = cfg.model
    assert (m.ffn_size, m.query_groups, m.max_positions, m.swiglu) == (96, 2, 64, True)
    assert cfg.model.padded_vocab_size(2) == 1024
    assert cfg.parallel.virtual_pipeline_size(m.num_layers) == 2
    assert cfg.precision.params_dtype == torch.bfloat16
    assert cfg.distributed.timeout_minutes == 3 and cfg.training.seed == 7


def test_swiglu_default_ffn_matches_megatron():
    assert ModelConfig(hidden_size=768, num_attention_heads=12, swiglu=True).ffn_size == 2048


def test_config_is_frozen():
    cfg = parse_args(BASE, world_size=1)
    with pytest.raises(AttributeError):
        cfg.model.hidden_size = 3


RULES = [
    # (extra flags, world size, flag the message must name)
    (["--hidden-size", "60"], 1, "--hidden-size"),
    (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads"),
    (["--num-query-groups", "3"], 1, "--num-query-groups"),
    (["--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4, "--num-query-groups"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3"),
    (["--pipeline-model-parallel-size", "3"], 3, "--pipeline-model-parallel-size"),
    (
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        1,
        "--num-layers-per-virtual-pipeline-stage",
    ),
    (
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
        2,
        "--num-layers-per-virtual-pipeline-stage",
    ),
    (["--fp16", "--bf16"], 1, "--fp16/--bf16"),
    (["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"], 4, "--ffn-hidden-size"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "--seq-length"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout"),
    (["--attention-dropout", "-0.1"], 1, "--attention-dropout"),
    (["--init-method-std", "0"], 1, "--init-method-std"),
    (["--kv-channels", "7", "--position-embedding-type", "rope"], 1, "rope"),
    (["--num-layers", "0"], 1, "--num-layers"),
    (["--vocab-size", "0"], 1, "--vocab-size"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size"),
    (["--micro-batch-size", "2", "--global-batch-size", "6"], 2, "--global-batch-size"),
    (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes"),
    (["--tensor-model-parallel-size", "0"], 1, "--tensor-model-parallel-size"),
]


@pytest.mark.parametrize(
    "extra,world,flag", RULES, ids=[r[2] + str(i) for i, r in enumerate(RULES)]
)
def test_each_rule_fails_fast_naming_the_flag_and_fix(extra, world, flag):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *extra], world_size=world)
    assert flag in str(err.value) and "Fix:" in str(err.value)


def test_a_misspelled_flag_gets_did_you_mean(capsys):
    argv = [*BASE, "--hiden-size", "64", "--moe-router-top-k=2", "--no-such-thing", "1"]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=1)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(
        "unrecognized arguments: --hiden-size 64 --moe-router-top-k=2 --no-such-thing 1 "
        "(--hiden-size: did you mean --hidden-size?; "
        "--moe-router-top-k: did you mean --moe-router-topk?)"
    ), last


def test_unknown_choice_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--normalization", "BatchNorm"], world_size=1)
    assert "--normalization" in capsys.readouterr().err


def test_world_size_comes_from_launcher_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_args([*BASE, "--tensor-model-parallel-size", "2"]).parallel.data_parallel_size == 2
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert parse_args(BASE).parallel.world_size == 8


def test_unknown_vocab_size_is_a_clear_error():
    with pytest.raises(ConfigError, match="--vocab-size"):
        ModelConfig().padded_vocab_size(1)


TRAIN = [*BASE, "--train-iters", "10", "--lr", "1e-3"]
TRAINING_RULES = [
    # (base flags, extra flags, world size, the flag the message must name)
    (BASE + ["--lr", "1e-3"], [], 1, "--train-iters/--train-samples"),
    (TRAIN, ["--train-samples", "100"], 1, "--train-iters/--train-samples"),
    (BASE + ["--train-iters", "10"], [], 1, "--lr"),
    (TRAIN, ["--min-lr", "1e-2"], 1, "--min-lr"),
    (TRAIN, ["--lr-warmup-fraction", "1.5"], 1, "--lr-warmup-fraction"),
    (TRAIN, ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 1, "--lr-warmup-fraction"),
    (
        TRAIN,
        ["--override-lr-scheduler", "--use-checkpoint-lr-scheduler"],
        1,
        "--override-lr-scheduler",
    ),
    (TRAIN, ["--loss-scale", "-1"], 1, "--loss-scale"),
    (TRAIN, ["--initial-loss-scale", "1", "--min-loss-scale", "4"], 1, "--initial-loss-scale"),
    (TRAIN, ["--clip-grad", "-1"], 1, "--clip-grad"),
    (TRAIN, ["--save-interval", "5"], 1, "--save-interval"),
    (TRAIN, ["--exit-duration-in-mins", "0"], 1, "--exit-duration-in-mins"),
    (TRAIN, ["--eval-iters", "-1"], 1, "--eval-iters"),
    (TRAIN, ["--log-interval", "0"], 1, "--log-interval"),
    (
        TRAIN,
        ["--rampup-batch-size", "2", "2", "100", "--global-batch-size", "8"],
        1,
        "--rampup-batch-size",
    ),
    (
        BASE + ["--train-samples", "100", "--lr", "1e-3"],
        ["--rampup-batch-size", "3", "2", "100", "--global-batch-size", "8"],
        1,
        "--rampup-batch-size",
    ),
    (
        TRAIN,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "3",
        ],
        2,
        "--num-layers-per-virtual-pipeline-stage",
    ),
]


@pytest.mark.parametrize(
    "argv,extra,world,flag",
    TRAINING_RULES,
    ids=[f"{r[3]}{i}" for i, r in enumerate(TRAINING_RULES)],
)
def test_each_training_rule_fails_fast_naming_the_flag(argv, extra, world, flag):
    from megatron.config.rules import validate

    with pytest.raises(ConfigError) as err:
        validate(parse_args([*argv, *extra], world_size=world), "train-gpt")
    assert flag in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--data-path", "a", "--train-data-path", "b"], "--data-path"),
        (["--data-path", "0.3", "a", "0.7"], "--data-path"),
        (["--data-path", "x", "a", "0.7", "b"], "--data-path"),
        (["--data-path", "-1", "a", "2", "b"], "--data-path"),
        (["--train-data-path", "0", "a", "0", "b"], "--train-data-path"),
        (["--split", "1,2,3,4"], "--split"),
        (["--recompute-num-layers", "0"], "--recompute-num-layers"),
    ],
)
def test_data_and_recompute_rules_fail_fast(extra, flag):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *extra], world_size=1)
    assert flag in str(err.value) and "Fix:" in str(err.value)


def test_a_valid_training_config_passes():
    from megatron.config.rules import validate

    validate(
        parse_args(
            [*TRAIN, "--lr-warmup-fraction", "0.01", "--save", "ck", "--save-interval", "5"],
            world_size=1,
        ),
        "train-gpt",
    )
    cfg = parse_args(
        BASE
        + [
            "--train-samples",
            "100",
            "--lr",
            "1e-3",
            "--rampup-batch-size",
            "2",
            "2",
            "100",
            "--global-batch-size",
            "8",
        ],
        world_size=1,
    )
    validate(cfg, "train-gpt")
    assert cfg.training.rampup_batch_size == (2, 2, 100)


def test_every_default_and_flag_comes_from_its_one_declaration():
    from megatron.config.cli import build_parser
    from megatron.config.declare import Tree
    from megatron.config.schema import MegatronConfig

    assert parse_args([], world_size=1) == MegatronConfig()
    options = build_parser()._option_string_actions
    for s in Tree(MegatronConfig).settings.values():
        assert s.from_env or all(f in options for f in s.flags), s.path
        assert s.help, f"{s.path} needs a help text"


def test_megatron_aliases_inverted_booleans_and_shortcuts():
    cfg = parse_args(
        [
            *BASE,
            "--checkpoint-num-layers",
            "2",
            "--recompute-granularity",
            "selective",
            "--checkpoint-activations",  # the classic flag wins, wherever it stands
            "--local_rank",
            "3",
            "--deepspeed-config",
            "ds.json",
            "--no-persist-layer-norm",
            "--disable-bias-linear",
            "--no-overlap-grad-reduce",
            "--deepspeed",  # the ZeRO flags are DeepSpeed's: without it they fail
            "--zero-reduce-scatter",
        ],
        world_size=1,
    )
    assert (cfg.recompute.granularity, cfg.recompute.num_layers) == ("full", 2)
    assert cfg.distributed.local_rank == 3 and not cfg.distributed.overlap_grad_reduce
    assert cfg.deepspeed.config == "ds.json" and cfg.deepspeed.zero_reduce_scatter is True
    assert not cfg.kernels.layer_norm_fusion and not cfg.model.add_bias_linear
    plain = parse_args(BASE, world_size=1)
    assert plain.deepspeed.zero_reduce_scatter is None and plain.recompute.granularity is None
    assert parse_args([*BASE, "--local-rank", "1"], world_size=1).distributed.local_rank == 1


def test_the_data_tools_take_the_tokenizer_flags_from_the_declarations(capsys):
    from megatron.config.declare import section_from_args
    from megatron.config.schema_data import TokenizerConfig
    from megatron.data.preprocess_args import build_parser

    io = ["--input", "x.jsonl", "--output-prefix", "out"]
    ns = build_parser().parse_args(
        [*io, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v"]
    )
    assert section_from_args(TokenizerConfig, ns) == TokenizerConfig("GPT2BPETokenizer", "v")
    assert section_from_args(TokenizerConfig, build_parser().parse_args(io)) == TokenizerConfig()
    with pytest.raises(SystemExit):
        build_parser().parse_args([*io, "--tokenizer-type", "Nope"])
    assert "--tokenizer-type" in capsys.readouterr().err


# What each package of megatron/ may import from the others (docs/architecture.md): lower
# layers never import upper ones, and only the trainer and the tools read the command line.
_MAY_IMPORT = {
    "mpu": set(),
    # the pipeline schedules: pure, below config (whose --pipeline-schedule reads them)
    "schedules": set(),
    "config": {"schedules"},
    "fused_kernels": {"config.schema", "config.schema_kernels", "mpu"},
    "model": {"config.declare", "config.layer_pattern", "config.schema", "config.schema_recompute"}
    | {"fused_kernels", "mpu", "schedules"},
    "data": {"config.schema", "config.declare", "config.schema_data", "config.schema_data_corpora"}
    | {"fileio", "progress"},
    "heartbeat": set(),
    "fileio": set(),
    # planning runs before any model or process group exists
    "planning": {"config.declare", "config.optimizers", "config.schema", "config.rules"}
    | {"schedules"},
    "progress": set(),
    "initialize": {"config.declare", "config.schema", "config.schema_parallel", "heartbeat"}
    | {"mpu"},
    # The generic code names no model family: it reads the families' registrations in
    # megatron.model.families, on its own floor (megatron.models sits above it).
    "checkpoint": {"config.schema", "fileio", "model", "mpu"},
    # the data-parallel wrappers sit beside the model, below the optimizers and the loop
    "data_parallel": {"config.schema", "config.schema_distributed", "mpu"},
    # start-up checks, torchft and the straggler detector: what the loop calls, never the loop
    "resilience": {"checkpoint", "config.declare", "config.schema", "config.schema_data", "data"}
    | {"fileio", "mpu"},
    "inference": {"checkpoint", "config.inference", "config.rules", "config.schema", "data"}
    | {"config.schema_data", "config.schema_kernels", "fused_kernels"}
    | {"initialize", "progress"}
    | {"model", "mpu"},
}
# Above them: the trainer (which may use any layer below it, but nothing of megatron.models)
# and the model families, each of which may use everything but another family.
_GENERIC_ABOVE = ("training", "optim")


def _megatron_imports(path) -> set[str]:
    """'pkg' (or 'config.module') of every megatron import in a file."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module in ("megatron", "megatron.models"):
                names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron" and len(parts) > 1:
                found.add(".".join(parts[1:3]) if parts[1] in ("config", "models") else parts[1])
    return found


def test_imports_follow_the_layers():
    root = ROOT / "megatron"
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        package = parts[0].removesuffix(".py")
        imports = _megatron_imports(path)
        families = {i for i in imports if i.startswith("models.")}
        if package in _GENERIC_ABOVE:
            above = {i for i in imports if i.startswith("models")}
            assert not above, f"{path} imports {sorted(above)}: read megatron.model.families"
        if package == "models" and len(parts) > 2:  # megatron/models/<family>/...
            others = {f for f in families if f != f"models.{parts[1]}"}
            assert not others, f"{path} imports another family's code: {sorted(others)}"
        if package not in _MAY_IMPORT:
            continue  # training, the model families and the package root sit on top
        own = {i for i in imports if i.split(".")[0] == package}
        wrong = imports - own - _MAY_IMPORT[package]
        assert not wrong, f"{path} imports {sorted(wrong)}: a lower layer imports an upper one"
    # The inference tools share code through the library, not through each other.
    for path in (root / "inference").glob("*.py"):
        text = path.read_text()
        for cli in ("generate_cli", "evaluate_cli", "server"):
            if path.stem != cli:
                assert f"megatron.inference.{cli} " not in text, f"{path} imports {cli}"


def _module_graph() -> dict[str, set[str]]:
    """megatron module -> the megatron modules it imports (anywhere in the file, lazy too)."""
    import ast

    root = ROOT / "megatron"
    files = {}
    for path in root.rglob("*.py"):
        parts = ("megatron", *path.relative_to(root).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                # `from pkg import submodule` imports the submodule; `from pkg import name`, pkg.
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [s if s in files else node.module for s in subs]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {n for n in names if n in files and n != name}
    return graph


def test_no_module_imports_round_a_circle():
    """A circle (a imports b imports a), even through an import inside a function, means the
    two are one unit or something they share belongs in a third module below both."""
    graph, done = _module_graph(), set()

    def visit(name, path):
        if name in path:
            circle = path[path.index(name) :] + [name]
            raise AssertionError(f"modules import round a circle: {' -> '.join(circle)}")
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, [*path, name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_tests_mirror_the_package_and_import_no_test_module():
    """tests/<package>/ for megatron/<package>/ (plus the folders of what sits outside the
    package); what test modules share lives in tests/helpers/ or a conftest.py."""
    import ast

    tests = ROOT / "tests"
    assert not list(tests.glob("test_*.py")), "a test module belongs in the folder it tests"
    for path in tests.rglob("*.py"):
        if "fixtures" in path.relative_to(tests).parts:
            continue
        assert (path.parent / "__init__.py").exists(), f"{path.parent} needs an __init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("tests."):
                    last = name.split(".")[-1]
                    assert not last.startswith("test_") and last != "conftest", (
                        f"{path} imports {name}: move what it shares to tests/helpers/"
                    )
    packages = {p.name for p in (ROOT / "megatron").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in tests.iterdir() if (p / "__init__.py").exists()}
    beside = {"helpers", "entry_points", "docs", "gpu"}  # not megatron packages
    assert folders - beside <= packages, (
        f"test folders without a package: {folders - beside - packages}"
    )


def test_checkpoints_record_the_architecture_and_old_ones_still_load():
    import dataclasses

    from megatron.checkpoint.reading import load_shard
    from megatron.config.schema import model_config_from_saved
    from megatron.training.checkpoint_args import checkpoint_args

    cfg = parse_args([*BASE, "--torch-compile", "--checkpoint-activations"], world_size=1)
    saved = checkpoint_args(cfg)["model"]
    assert saved == dataclasses.asdict(cfg.model) and model_config_from_saved(saved) == cfg.model
    switches = {"torch_compile", "attention_backend", "recompute_granularity", "granularity"}
    assert not switches & set(saved), "run-time switches stay out of checkpoints"
    # A checkpoint written before the switches left ModelConfig: they are dropped on load.
    legacy_dir = FIXTURES / "legacy_checkpoint"
    legacy = load_shard(str(legacy_dir), 3, tp_rank=0, pp_rank=0, pp_size=1)["args"]["model"]
    assert {"torch_compile", "recompute_granularity", "masked_softmax_fusion"} <= set(legacy)
    rebuilt = model_config_from_saved(legacy)
    # Fields newer than the checkpoint (e.g. the v1.x architecture options) take defaults.
    defaults = dataclasses.asdict(type(rebuilt)())
    want = {k: legacy.get(k, defaults[k]) for k in dataclasses.asdict(rebuilt)}
    assert dataclasses.asdict(rebuilt) == want


def test_a_declared_limit_is_enforced_from_flags_files_and_code(tmp_path):
    """One declaration (`setting(..., min=, below=)`), one message, whatever built the config."""
    from megatron.config.schema_parallel import ParallelConfig
    from megatron.config.schema_training import TrainingConfig

    want = "--hidden-dropout: must be in [0, 1), got 1.5. Fix: pass --hidden-dropout in [0, 1)"
    with pytest.raises(ConfigError, match=re.escape(want)):
        parse_args([*BASE, "--hidden-dropout", "1.5"], world_size=1)
    run = tmp_path / "run.yaml"
    run.write_text("model: {hidden_dropout: 1.5}\n")
    with pytest.raises(ConfigError, match=re.escape(want)):
        parse_args([*BASE, "-c", str(run)], world_size=1)
    with pytest.raises(ConfigError, match=re.escape(want)):
        ModelConfig(hidden_dropout=1.5)
    with pytest.raises(ConfigError, match=re.escape("--num-workers: must be >= 0, got -1")):
        TrainingConfig(num_workers=-1)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size: must be >= 1, got 0"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ConfigError, match="--normalization: 'BatchNorm' is not a valid choice"):
        ModelConfig(normalization="BatchNorm")
    assert ModelConfig(hidden_dropout=0.0, vocab_size=None).hidden_dropout == 0.0  # limits hold


def test_the_limits_are_in_the_help(capsys):
    from megatron.config.cli import build_parser

    text = build_parser().format_help()
    assert "(in [0, 1))" in " ".join(text.split()) and "(>= 1)" in text


def test_a_setting_takes_one_lower_and_one_upper_limit():
    from megatron.config.declare import setting

    with pytest.raises(TypeError):
        setting(0.0, "x", min=0, above=0)


def test_one_validate_per_purpose_and_pretrain_applies_the_training_rules():
    from megatron.config.rules import PURPOSES, validate
    from megatron.training.loop import pretrain

    cfg = parse_args(BASE, world_size=1)  # valid settings, but no --train-iters / --lr
    assert validate(cfg) == cfg and validate(validate(cfg)) == cfg
    with pytest.raises(ConfigError, match="--train-iters/--train-samples"):
        validate(cfg, "train-gpt")
    with pytest.raises(ConfigError, match="--train-iters/--train-samples"):
        pretrain(cfg)  # refused before any process group or data work
    bert = parse_args([*BASE, "--mask-prob", "0.2", "--train-iters", "2", "--lr", "1"], 1)
    with pytest.raises(ConfigError, match="--mask-prob: a BERT pretraining setting"):
        validate(bert, "train-gpt")
    assert validate(bert, "eval-bert").data.tokenizer.tokenizer_type == "BertWordPieceLowerCase"
    with pytest.raises(ValueError, match="unknown purpose"):
        validate(cfg, "finetune")
    assert set(PURPOSES) == {"config", "train-gpt", "train-bert", "eval-bert", "inference"}


def test_inference_purpose_checks_one_replica():
    from megatron.config.inference import inference_config
    from megatron.config.rules import validate

    assert (
        validate(inference_config({}, 4, 2), "inference").parallel.tensor_model_parallel_size == 2
    )
    with pytest.raises(ConfigError, match="inference runs one model replica"):
        validate(inference_config({"parallel.tensor_model_parallel_size": 2}, 4), "inference")
    with pytest.raises(ConfigError, match="does not divide the 3 processes"):
        validate(inference_config({}, 3, 2), "inference")
    both = {"precision.fp16": True, "precision.bf16": True}
    with pytest.raises(ConfigError, match="--fp16/--bf16: both are set"):
        validate(inference_config(both, 1), "inference")


def test_the_deepspeed_json_is_read_once_before_start_up(tmp_path):
    import json

    from megatron.config.deepspeed_json import build_ds_config
    from megatron.config.rules import validate

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    argv = [*BASE, "--train-iters", "2", "--lr", "1e-3", "--deepspeed", "--deepspeed_config"]
    cfg = parse_args([*argv, str(path)], world_size=1, purpose="train-gpt")
    path.unlink()  # from here on nothing reads it
    assert cfg.deepspeed.config_json == {"zero_optimization": {"stage": 1}}
    assert build_ds_config(validate(cfg, "train-gpt"))["zero_optimization"]["stage"] == 1
    # Parsing alone does not need the file; a training run names it before any work.
    with pytest.raises(ConfigError, match="no such file"):
        parse_args([*argv, str(path)], world_size=1, purpose="train-gpt")
    assert parse_args([*argv, str(path)], world_size=1).deepspeed.config_json is None


def test_building_the_tokenizer_section_never_touches_the_disk(tmp_path, monkeypatch):
    from megatron.config import schema_data as schema
    from megatron.config.schema_data import TokenizerConfig

    (tmp_path / "gpt2-vocab.json").write_text("{}")
    (tmp_path / "gpt2-merges.txt").write_text("")
    calls = []
    real = schema.find_files
    monkeypatch.setattr(schema, "find_files", lambda *a: calls.append(a) or real(*a))
    tok = TokenizerConfig(tokenizer_model_type="gpt2", cache_dir=str(tmp_path))
    assert tok.vocab_file is None and tok.tokenizer_type is None and not calls
    found = tok.with_pretrained_files()  # the explicit resolution step
    assert found.tokenizer_type == "GPT2BPETokenizer" and found.vocab_file.endswith("vocab.json")
    assert found.with_pretrained_files() is found and len(calls) == 1


def test_recompute_method_and_separate_split_paths_from_the_command_line(tmp_path):
    """--recompute-method reaches the layers' recompute policy; --train/--valid/--test-data-path
    reach the data section the dataset builder reads (tests/data/test_gpt_dataset.py)."""
    from megatron.model.context import BuildContext
    from megatron.model.parallelize import apply_recompute
    from megatron.models.gpt.model import GPTModel

    argv = [*BASE, "--recompute-granularity", "full", "--recompute-method", "block"]
    argv += ["--recompute-num-layers", "2", "--train-data-path", str(tmp_path / "t")]
    argv += ["--valid-data-path", str(tmp_path / "v"), "--test-data-path", str(tmp_path / "x")]
    cfg = parse_args(argv, world_size=1)
    assert (cfg.recompute.method, cfg.recompute.num_layers) == ("block", 2)
    assert cfg.data.valid_data_path == (str(tmp_path / "v"),)
    assert cfg.data.test_data_path == (str(tmp_path / "x"),)
    model = GPTModel(cfg.model, BuildContext(seed=1))
    apply_recompute(model, cfg.recompute)
    policies = {m.layer_recompute for m in model.modules() if hasattr(m, "layer_recompute")}
    assert [(p.method, p.num_layers) for p in policies] == [("block", 2)]
    with pytest.raises(SystemExit):
        parse_args([*argv, "--recompute-method", "every"], world_size=1)
