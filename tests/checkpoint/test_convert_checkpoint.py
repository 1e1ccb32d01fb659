"""Checkpoint conversion: TP x PP resharding, Hugging Face export/import, the CLI.

Source checkpoints are made without the trainer: a TP = 1 model's weights are split into
TP x PP shards by tests/helpers/checkpoints.py's own split functions (checked here against
mpu.shard and the model's per-stage state dicts) and written with save_shard, as the trainer's
ranks would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron import mpu
from megatron.checkpoint.reading import load_shard, resolve_load_iteration
from megatron.checkpoint.resharding import (
    load_checkpoint,
    load_full_state,
    save_resharded,
    split_rule,
    stage_names,
)
from megatron.checkpoint.storage import tracker_path
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel, build_model
from tests.helpers.checkpoints import (
    VARIANTS,
    VOCAB,
    _args,
    _cli,
    _logits,
    _model,
    _my_split,
    _stage_keys,
    _tokens,
    _unpadded,
    _write_checkpoint,
)
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import MMAP, ROOT


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_split_rules_match_the_model_and_mpu_shard(variant):
    cfg = VARIANTS[variant]
    model = _model(cfg)
    for name, param in model.named_parameters():
        split = mpu.is_tensor_parallel(param)
        expected = (param.partition_dim, param.partition_stride) if split else None
        assert split_rule(name, cfg) == expected, name
        if split and name not in VOCAB:
            for r in range(2):
                ours = _my_split(name, param.detach(), cfg, 2, r)
                assert torch.equal(
                    ours, mpu.shard(param.detach(), *expected[:1], r, 2, expected[1])
                )
    for pp in (1, 2, 4):
        for pp_rank in range(pp):
            assert stage_names(cfg, pp, pp_rank) == _stage_keys(cfg, pp, pp_rank)
    # Interleaved, PP=2 x 2 chunks of one layer: what the trainer's build_model holds.
    for pp_rank in range(2):
        state = dataclasses.replace(
            mpu.single_process_state(), pp_size=2, pp_rank=pp_rank, virtual_pp_size=2
        )
        chunks = build_model(cfg, BuildContext(state, seed=1))
        assert set(stage_names(cfg, 2, pp_rank, vp_layers=1)) == set(chunks.state_dict())


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_pp2_to_tp1_pp1_gives_the_same_logits(tmp_path, variant, capsys):
    cfg = VARIANTS[variant]
    model = _model(cfg)
    _write_checkpoint(tmp_path / "src", model, cfg, tp=2, pp=2)
    loaded = load_checkpoint(str(tmp_path / "src"))
    assert (loaded.tp, loaded.pp, loaded.iteration) == (2, 2, 20)
    for name, tensor in _unpadded(model, cfg).items():
        assert torch.equal(loaded.state[name], tensor), name
    save_resharded(loaded.state, loaded.args, str(tmp_path / "dst"), 1, 1, 20, meta=loaded.meta)
    assert "--no-load-optim --no-load-rng" in capsys.readouterr().err

    dst = str(tmp_path / "dst")
    assert resolve_load_iteration(dst) == 20
    assert open(tracker_path(dst)).read().strip() == "20"
    shard = load_shard(dst, 20, tp_rank=0, pp_rank=0, pp_size=1)
    assert "optimizer" not in shard and "rng_state" not in shard
    assert shard["opt_param_scheduler"]["num_steps"] == 20
    assert (shard["consumed_train_samples"], shard["consumed_valid_samples"]) == (640, 32)
    assert shard["args"]["tensor_model_parallel_size"] == 1
    assert shard["args"]["padded_vocab_size"] == 72
    fresh = _model(cfg, seed=99)
    fresh.load_state_dict(shard["model"])  # strict: exactly the TP=1 model's names and shapes
    assert torch.equal(_logits(fresh, cfg), _logits(model, cfg))


def _tp_worker(rank, world, ckpt, cfg, expected):
    state = mpu.initialize_model_parallel(world, 1)
    shard = load_shard(ckpt, 20, tp_rank=state.tp_rank, pp_rank=0, pp_size=1)
    model = GPTModel(cfg, BuildContext(state, seed=5, dtype=torch.float32)).eval()
    model.load_state_dict(shard["model"])
    with torch.no_grad():
        local = model(_tokens(cfg))  # (b, s, V_pad / TP): this rank's vocab slice
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local.contiguous(), group=state.tp_group)
    full = torch.cat(gathered, dim=-1)
    torch.testing.assert_close(full[..., : cfg.vocab_size], expected, rtol=1e-5, atol=1e-5)
    assert torch.isinf(full[..., cfg.vocab_size :]).all()
    mpu.destroy_model_parallel(state)
    return tuple(shard["model"]["embedding.word_embeddings.weight"].shape)


@pytest.mark.slow
def test_tp2_pp2_to_tp4_repads_the_vocab_and_runs_on_4_ranks(tmp_path):
    cfg = VARIANTS["gpt2"]
    model = _model(cfg)
    _write_checkpoint(tmp_path / "src", model, cfg, tp=2, pp=2)
    state, args = load_full_state(str(tmp_path / "src"))
    assert state["embedding.word_embeddings.weight"].shape[0] == 70
    save_resharded(state, args, str(tmp_path / "tp4"), 4, 1, 20, quiet=True)
    for r in range(4):
        shard = load_shard(str(tmp_path / "tp4"), 20, tp_rank=r, pp_rank=0, pp_size=1)
        assert shard["args"]["padded_vocab_size"] == 96  # was 80 at TP=2
        emb = shard["model"]["embedding.word_embeddings.weight"]
        assert emb.shape == (24, 32)
        real = min(24, max(0, 70 - 24 * r))  # rank 2: rows 48..69 real; rank 3: all padding
        assert torch.count_nonzero(emb[real:]) == 0
        assert torch.count_nonzero(emb[:real], dim=1).gt(0).all()
    merged, _ = load_full_state(str(tmp_path / "tp4"))
    original = _unpadded(model, cfg)
    assert list(merged) == list(original)
    assert all(torch.equal(merged[n], original[n]) for n in original)
    shapes = run_distributed(_tp_worker, 4, str(tmp_path / "tp4"), cfg, _logits(model, cfg))
    assert shapes == [(24, 32)] * 4


def test_bad_target_sizes_name_the_flag(tmp_path, capsys):
    cfg = VARIANTS["llama"]
    _write_checkpoint(tmp_path / "src", _model(cfg), cfg, tp=1, pp=1)
    main = _cli()
    cases = {
        "--target-tensor-model-parallel-size": ["--target-tensor-model-parallel-size", "3"],
        "--num-query-groups": ["--target-tensor-model-parallel-size", "8"],  # 8 heads, 4 groups
        "--target-pipeline-model-parallel-size": ["--target-pipeline-model-parallel-size", "3"],
    }
    for flag, extra in cases.items():
        code = main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "x"), *extra])
        err = capsys.readouterr().err
        assert code == 1 and err.startswith("error: ") and flag in err, err
    assert not os.path.exists(tmp_path / "x" / "iter_0000020")
    # An existing target checkpoint is never overwritten.
    assert main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "src")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["--load", str(tmp_path / "nothing"), "--save", str(tmp_path / "y")]) == 1


@pytest.mark.slow
def test_cli_script_reshards_end_to_end(tmp_path):
    cfg = VARIANTS["llama"]
    model = _model(cfg)
    _write_checkpoint(tmp_path / "src", model, cfg, tp=2, pp=2)
    cmd = [
        sys.executable,
        os.path.join("tools", "convert_checkpoint.py"),
        "--load", str(tmp_path / "src"),
        "--save", str(tmp_path / "dst"),
        "--target-tensor-model-parallel-size", "1",
        "--target-pipeline-model-parallel-size", "4",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "TP=2 x PP=2" in done.stdout and "--finetune" in done.stderr
    state, args = load_full_state(str(tmp_path / "dst"))
    assert args["pipeline_model_parallel_size"] == 4
    assert all(torch.equal(state[n], t) for n, t in _unpadded(model, cfg).items())


# ---- Hugging Face ---------------------------------------------------------------------------


def _hf_logits(out_dir: str, variant: str) -> torch.Tensor:
    transformers = pytest.importorskip("transformers", reason="HF export checks need transformers")
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[variant]
    hf, info = cls.from_pretrained(out_dir, local_files_only=True, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    hf.eval()
    with torch.no_grad():
        return hf(_tokens(VARIANTS[variant])).logits


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_to_hf_gives_the_same_logits_in_transformers(tmp_path, variant):
    pytest.importorskip("transformers", reason="HF export checks need transformers")
    from megatron.models.gpt.hf import to_hf

    cfg = VARIANTS[variant]
    model = _model(cfg)
    _write_checkpoint(tmp_path / "src", model, cfg, tp=2, pp=2)
    state, args = load_full_state(str(tmp_path / "src"))
    assert to_hf(state, args, str(tmp_path / "hf")) == variant
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["vocab_size"] == 70
    torch.testing.assert_close(
        _hf_logits(str(tmp_path / "hf"), variant), _logits(model, cfg), rtol=1e-5, atol=1e-5
    )


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_from_hf_then_to_hf_round_trips_exactly(tmp_path, variant):
    pytest.importorskip("safetensors", reason="HF files are safetensors")
    from megatron.models.gpt.hf import to_hf

    cfg = VARIANTS[variant]
    tokenizer = None
    if variant == "gpt2":  # the fixture BPE: 8192 tokens, <|endoftext|> = 0
        cfg = dataclasses.replace(cfg, vocab_size=8192)
        tokenizer = {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": os.path.join(MMAP, "vocab.json"),
            "merge_file": os.path.join(MMAP, "merges.txt"),
        }
    _write_checkpoint(tmp_path / "src", _model(cfg), cfg, tp=1, pp=1, tokenizer=tokenizer)
    state, args = load_full_state(str(tmp_path / "src"))
    to_hf(state, args, str(tmp_path / "hf1"))
    main = _cli()
    hf1, hf2, ck = (str(tmp_path / d) for d in ("hf1", "hf2", "ck"))
    assert main(["--from-hf", hf1, "--save", ck, "--target-tensor-model-parallel-size", "2"]) == 0
    assert resolve_load_iteration(ck) == 0  # Megatron's `release`
    assert main(["--load", ck, "--to-hf", hf2]) == 0
    umask = os.umask(0o22)
    os.umask(umask)  # the file is as readable as any the user writes (safetensors leaves 0600)
    assert os.stat(os.path.join(hf1, "model.safetensors")).st_mode & 0o777 == 0o666 & ~umask
    with open(os.path.join(hf1, "model.safetensors"), "rb") as a:
        with open(os.path.join(hf2, "model.safetensors"), "rb") as b:
            assert a.read() == b.read()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(hf1, name)):
            assert json.load(open(os.path.join(hf1, name))) == json.load(
                open(os.path.join(hf2, name))
            ), name
    back, _ = load_full_state(ck)
    assert all(torch.equal(back[n], t) for n, t in state.items())
    if variant == "gpt2":
        assert json.load(open(os.path.join(hf2, "config.json")))["eos_token_id"] == 0
        transformers = pytest.importorskip("transformers")
        from megatron.data.tokenizers import build_tokenizer

        hf_tok = transformers.AutoTokenizer.from_pretrained(hf2, local_files_only=True)
        ours = build_tokenizer(
            "GPT2BPETokenizer", **{k: tokenizer[k] for k in tokenizer if k != "tokenizer_type"}
        )
        text = "def main(argv):\n    return 0  # ok"
        assert hf_tok.encode(text) == ours.tokenize(text)


def test_unsupported_architecture_names_what_it_would_need():
    from megatron.models.gpt.hf import hf_architecture

    cfg = dataclasses.replace(VARIANTS["gpt2"], swiglu=True)
    with pytest.raises(ValueError, match="LlamaForCausalLM would need --position-embedding-type"):
        hf_architecture(cfg)
    gqa = dataclasses.replace(VARIANTS["gpt2"], num_query_groups=2)
    with pytest.raises(ValueError, match="GPT2LMHeadModel would need no --num-query-groups"):
        hf_architecture(gqa)


def _hf_model(variant: str):
    transformers = pytest.importorskip("transformers", reason="HF import checks need transformers")
    if variant == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=70, n_positions=16, n_embd=32, n_layer=2, n_head=4, n_inner=48,
            activation_function="gelu", layer_norm_epsilon=1e-6, tie_word_embeddings=True,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=70, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=16,
            rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_from_hf_reads_what_transformers_writes(tmp_path, variant):
    from megatron.checkpoint.resharding import model_config
    from megatron.models.gpt.hf import from_hf

    hf = _hf_model(variant)
    hf.save_pretrained(str(tmp_path / "hf"))
    state, args = from_hf(str(tmp_path / "hf"))
    cfg = model_config(args)
    assert cfg.vocab_size == 70 and cfg.num_layers == 2
    save_resharded(state, args, str(tmp_path / "ck"), 1, 1, 0, quiet=True)
    ours = _model(cfg, seed=11)
    ours.load_state_dict(
        load_shard(str(tmp_path / "ck"), 0, tp_rank=0, pp_rank=0, pp_size=1)["model"]
    )
    tokens = _tokens(cfg)
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(ours(tokens)[..., :70].detach(), expected, rtol=1e-5, atol=1e-5)


def test_from_hf_reads_hub_style_gpt2_names(tmp_path):
    """Hub GPT-2 files name tensors without `transformer.` and carry causal-mask buffers."""
    pytest.importorskip("safetensors", reason="HF files are safetensors")
    from safetensors.torch import save_file

    from megatron.models.gpt.hf import from_hf, to_hf

    cfg = VARIANTS["gpt2"]
    state = _unpadded(_model(cfg), cfg)
    to_hf(state, _args(cfg, 1, 1), str(tmp_path / "hf"))
    path = str(tmp_path / "hf" / "model.safetensors")
    tensors = {n.removeprefix("transformer."): t for n, t in _safetensors(path).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    save_file(tensors, path)
    back, args = from_hf(str(tmp_path / "hf"))
    assert all(torch.equal(back[n], t) for n, t in state.items())
    assert args["tokenizer"]["tokenizer_type"] is None


# ---- the trainer on both sides ----------------------------------------------------------------


def _train_worker(rank, world, argv):
    from megatron.config.cli import parse_args
    from megatron.config.rules import validate
    from megatron.training.loop import pretrain

    cfg = parse_args(argv, world_size=world)
    validate(cfg, "train-gpt")
    result = pretrain(cfg, out=open(os.devnull, "w"))
    return [h["lm_loss"] for h in result.history], result.iteration


@pytest.mark.slow
def test_trainer_resumes_a_pp2_checkpoint_resharded_to_tp2(tmp_path):
    """PP=2 training saves at iteration 3; the TP=2 conversion, resumed with --no-load-optim
    --no-load-rng, computes iteration 4's loss from the same weights and samples."""
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefix = str(tmp_path / "toy")
    rng = np.random.default_rng(0)
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(200):
        start, stride, n = rng.integers(0, 100), rng.integers(1, 4), rng.integers(5, 60)
        builder.add_document([(start + stride * np.arange(n)) % 100])
    builder.finalize(f"{prefix}.idx")
    argv = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 100 "
        "--make-vocab-size-divisible-by 8 --hidden-dropout 0 --attention-dropout 0 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 3e-3 --split 90,10,0 "
        "--eval-interval 100 --eval-iters 1 --num-workers 0 --log-interval 1 --seed 7 "
        f"--data-path {prefix}"
    ).split()
    src, dst = str(tmp_path / "pp2"), str(tmp_path / "tp2")
    pp_run = ["--pipeline-model-parallel-size", "2", "--save", src, "--save-interval", "3"]
    losses, _ = run_distributed(_train_worker, 2, argv + pp_run)[1]  # the last stage logs
    main = _cli()
    args = ["--load", src, "--iteration", "3", "--save", dst]
    sizes = [
        "--target-tensor-model-parallel-size",
        "2",
        "--target-pipeline-model-parallel-size",
        "1",
    ]
    assert main([*args, *sizes]) == 0
    resume = [
        "--tensor-model-parallel-size",
        "2",
        "--load",
        dst,
        "--no-load-optim",
        "--no-load-rng",
    ]
    (resumed, iteration), _ = run_distributed(_train_worker, 2, argv + resume)
    assert iteration == 4 and len(resumed) == 1
    assert resumed[0] == pytest.approx(losses[3], rel=1e-5)
