"""Resume straight from --load on another layout, optimizer moments included, with the
uninterrupted run's losses: TP2xPP2 -> TP1xPP4, TP2 -> TP4 (distributed optimizer), plain
optimizer -> distributed optimizer (TP2xPP2 -> TP1xPP2xDP2), PP2 interleaved -> PP2 plain; an
MoE GPT (router, shared expert) trained with expert parallelism resumed on another TP x PP x EP
with either optimizer, to the uninterrupted run's losses and weights; an --async-save run's
checkpoints load to the sync run's state; bad input gets named errors and overwrites nothing.
(DP4 -> DP2 with the distributed optimizer: test_distributed_optimizer.)
Two 4-rank spawns in all: one for the uninterrupted runs, one for every resume."""

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.checkpoint import resharding as R
from megatron.checkpoint.reading import load_shard
from megatron.checkpoint.reshard_load import (
    LayoutVersionError,
    RankTarget,
    SavedShards,
    read_layout,
    read_rank_state,
)
from megatron.checkpoint.storage import MARKER_NAME, CheckpointError, checkpoint_dir
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.model.families import vocab_sized_names
from megatron.models.gpt.model import GPTModel
from megatron.mpu.parallel_state import single_process_state
from tests.helpers.checkpoints import _checkpoint_at
from tests.helpers.distributed import run_distributed
from tests.helpers.training import _losses, _train, flags

DISTRIB = ["--use-distributed-optimizer"]
TP = "--tensor-model-parallel-size"
PP = "--pipeline-model-parallel-size"
VP = "--num-layers-per-virtual-pipeline-stage"
EP = "--expert-model-parallel-size"
# Every layer an MoE of 4 experts (top 2) with a shared expert (TP-split like an MLP).
MOE = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01"]
MOE += ["--moe-shared-expert-intermediate-size", "16"]
# Source layouts (4 ranks, saved at iterations 3 and 6) -> the layouts that resume them.
SOURCES = {
    "tp2pp2": [TP, "2", PP, "2"],
    "tp2dp2-distributed": [TP, "2", *DISTRIB],
    "pp2-interleaved-dp2": [PP, "2", VP, "1"],
    "moe-tp2ep2": [*MOE, TP, "2", EP, "2"],
    "moe-pp2ep2-distributed": [*MOE, PP, "2", EP, "2", *DISTRIB],
}
RESUMES = {
    "TP2xPP2 -> TP1xPP4": ("tp2pp2", [PP, "4"]),
    "TP2xPP2 plain -> TP1xPP2xDP2 distributed": ("tp2pp2", [PP, "2", *DISTRIB]),
    "TP2 -> TP4, distributed": ("tp2dp2-distributed", [TP, "4", *DISTRIB]),
    "PP2 interleaved -> PP2 plain": ("pp2-interleaved-dp2", [PP, "2"]),
    # MoE: the experts (saved whole) cut for this EP rank while TP / PP change
    "MoE TP2xEP2 -> TP1xPP2xEP2": ("moe-tp2ep2", [*MOE, PP, "2", EP, "2"]),
    "MoE TP2xEP2 plain -> EP4 distributed": ("moe-tp2ep2", [*MOE, EP, "4", *DISTRIB]),
    "MoE PP2xEP2 distributed -> TP2xEP2": ("moe-pp2ep2-distributed", [*MOE, TP, "2", EP, "2"]),
    "MoE PP2xEP2 distributed -> TP2xEP2 distributed": (
        "moe-pp2ep2-distributed",
        [*MOE, TP, "2", EP, "2", *DISTRIB],
    ),
}


def _base(prefix):
    return flags(prefix, "--num-layers", "4", "--adam-eps", "1e-4", iters=6)


def _straight_worker(rank, world, base, root):
    """Every source layout straight to 6, saving at 3 and 6; the TP2xPP2 one again with
    --async-save."""
    out = {}
    for name, extra in SOURCES.items():
        save = ["--save", os.path.join(root, name), "--save-interval", "3"]
        out[name] = _train(rank, world, [*base, *extra, *save])[0]
    save = ["--save", os.path.join(root, "tp2pp2-async"), "--save-interval", "3", "--async-save"]
    out["tp2pp2-async"] = _train(rank, world, [*base, *SOURCES["tp2pp2"], *save])[0]
    return out


def _resume_worker(rank, world, base, runs, bad):
    out = {
        what: _train(rank, world, [*base, *extra, "--load", load])[0] for what, load, extra in runs
    }
    for what, load, extra in bad:  # each must fail with a named CheckpointError
        try:
            _train(rank, world, [*base, *extra, "--load", load, "--save", load])
        except CheckpointError as e:
            out[what] = f"{type(e).__name__}: {e}"
        else:
            out[what] = "no error"
    return out


def _tree_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _tree_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _tree_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _digest(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_resume_on_a_new_layout_continues_the_uninterrupted_run(data_prefix, tmp_path):
    base = _base(data_prefix)
    root = str(tmp_path / "straight")
    straight = run_distributed(_straight_worker, 4, base, root, timeout=600)[-1]

    # --async-save wrote what the synchronous save writes: the same state, shard for shard.
    for it in (3, 6):
        sync, async_ = (os.path.join(root, n) for n in ("tp2pp2", "tp2pp2-async"))
        for tp in range(2):
            for pp in range(2):
                where = {"tp_rank": tp, "pp_rank": pp, "pp_size": 2}
                _tree_equal(load_shard(sync, it, **where), load_shard(async_, it, **where))
    assert _losses(straight["tp2pp2-async"]) == _losses(straight["tp2pp2"])

    at3 = {n: _checkpoint_at(os.path.join(root, n), 3, tmp_path / f"{n}-at3") for n in SOURCES}
    runs = [(what, at3[src], extra) for what, (src, extra) in RESUMES.items()]
    # The MoE resumes save at 6 too: their weights are compared with the uninterrupted run's.
    moe_saves = {what: str(tmp_path / f"resumed-{i}") for i, what in enumerate(RESUMES)}
    moe_saves = {what: d for what, d in moe_saves.items() if what.startswith("MoE")}
    runs = [
        (what, load, [*extra, "--save", moe_saves[what], "--save-interval", "3"])
        if what in moe_saves
        else (what, load, extra)
        for what, load, extra in runs
    ]
    # Bad input: a newer layout record; a model of another shape (TP4, so it reshards).
    future = _checkpoint_at(os.path.join(root, "tp2pp2"), 3, tmp_path / "future")
    marker = Path(checkpoint_dir(future, 3)) / MARKER_NAME
    record = json.loads(marker.read_text())
    record["layout"]["version"] = 99
    marker.write_text(json.dumps(record))
    wide = [TP, "4", "--hidden-size", "64"]
    bad = [("future", future, [PP, "4"]), ("shape", at3["tp2pp2"], wide)]
    before = {load: _digest(load) for _, load, _ in bad}
    results = run_distributed(_resume_worker, 4, base, runs, bad, timeout=600)
    last = results[-1]
    for what, (src, _) in RESUMES.items():
        history = last[what]
        assert [h["iteration"] for h in history] == [4, 5, 6], what
        # fp32; TP/PP changes sum in another order: a few ulps apart.
        np.testing.assert_allclose(
            _losses(history), _losses(straight[src])[3:], rtol=2e-5, err_msg=what
        )
    for what, saved in moe_saves.items():  # every expert, router and shared expert weight
        want = R.load_full_state(os.path.join(root, RESUMES[what][0]), 6)[0]
        got = R.load_full_state(saved, 6)[0]
        assert got.keys() == want.keys() and any(".experts." in n for n in got), what
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    for rank, out in enumerate(results):
        assert "records checkpoint layout version 99" in out["future"], (rank, out["future"])
        assert "written by a newer version" in out["future"]
        assert "hidden_size=32" in out["shape"] and "64" in out["shape"], (rank, out["shape"])
    for _, load, _ in bad:
        assert _digest(load) == before[load], f"{load} was changed by a failed resume"


# ----------------------------------------------------------------------- the planner, in-process


def _full_state(cfg: ModelConfig) -> dict:
    torch.manual_seed(0)
    model = GPTModel(cfg, BuildContext(single_process_state()))
    full = {n: t.clone() for n, t in model.state_dict().items()}
    for name in vocab_sized_names():
        if name in full:
            full[name] = full[name][: cfg.vocab_size]
    return full


@pytest.fixture(scope="module")
def saved_tp2_pp2(tmp_path_factory):
    """A TP2 x PP2 checkpoint of a SwiGLU GPT (stride-2 split) with its full state."""
    cfg = ModelConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100, swiglu=True
    )
    full = _full_state(cfg)
    root = str(tmp_path_factory.mktemp("planner") / "tp2pp2")
    _save(cfg, full, root, tp=2, pp=2)
    return cfg, full, root


def _save(cfg: ModelConfig, full: dict, root: str, tp: int, pp: int) -> None:
    """`full` written at TP x PP (iteration 5) by the converter's split."""
    args = {
        "model": dataclasses.asdict(cfg),
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "padded_vocab_size": cfg.padded_vocab_size(1),
    }
    R.save_resharded(full, args, root, tp, pp, 5, quiet=True)


def _target(cfg, full, tp, pp, pp_rank, tp_rank):
    rules = R.model_layout(cfg)[1]
    padded = cfg.padded_vocab_size(tp)
    names = R.stage_names(cfg, pp, pp_rank)
    expected = {n: R._local_tensor(n, full[n], rules[n], tp, tp_rank, padded) for n in names}
    shapes = {n: tuple(t.shape) for n, t in expected.items()}
    rules = {n: rules[n] for n in names}
    vocab = frozenset(vocab_sized_names())
    return RankTarget(shapes, rules, tp, tp_rank, cfg.vocab_size, vocab), expected


@pytest.mark.parametrize("tp,pp", [(4, 1), (1, 4), (1, 1), (2, 2)])
def test_each_rank_reads_exactly_its_slices(saved_tp2_pp2, tp, pp):
    cfg, full, root = saved_tp2_pp2
    layout = read_layout(root, 5)
    assert (layout.tp, layout.pp, layout.recorded) == (2, 2, True)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shards = SavedShards(root, 5, layout, lambda n: R.split_rule(n, cfg))
            target, expected = _target(cfg, full, tp, pp, pp_rank, tp_rank)
            got, optimizer = read_rank_state(shards, target, with_optimizer=True)
            assert optimizer is None  # the converter wrote no optimizer state
            for name, tensor in expected.items():
                assert torch.equal(got[name], tensor), (tp, pp, tp_rank, name)
            # A TP4 rank reads the data of one saved TP rank; a TP1 rank both. A PP4 stage
            # reads only the saved stage that held its layers (the last one also the tied
            # word embedding, from the first saved stage).
            assert {k for k, _ in shards.read} == ({tp_rank * 2 // tp} if tp > 1 else {0, 1})
            if pp == 4:
                tied = {0} if pp_rank == 3 else set()
                assert {p for _, p in shards.read} == {pp_rank // 2} | tied, shards.read


def test_an_ep_rank_reads_its_experts_and_every_other_tensor_as_dense(tmp_path):
    """An MoE checkpoint (experts whole, router, shared expert) saved at TP2 read by the ranks
    of TP1 x EP2 and TP2 x EP4: each gets rows [r E / EP, (r + 1) E / EP) of every expert
    tensor, its TP slice of everything else, and its experts' range of the whole tensor."""
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=100,
        swiglu=True,
        num_experts=4,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True,
    )
    full = _full_state(cfg)
    root = str(tmp_path / "moe-tp2")
    _save(cfg, full, root, tp=2, pp=1)
    layout = read_layout(root, 5)
    experts = frozenset(n for n in full if ".mlp.experts." in n)
    router = [n for n in full if ".mlp.router." in n]
    assert len(experts) == 8 and router  # 2 layers x weight1, weight2, bias1, bias2
    for tp, ep in ((1, 2), (2, 4)):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                target, expected = _target(cfg, full, tp, 1, 0, tp_rank)
                shapes = {
                    n: (s[0] // ep, *s[1:]) if n in experts else s for n, s in target.shapes.items()
                }
                target = dataclasses.replace(
                    target, shapes=shapes, experts=experts, ep=ep, ep_rank=ep_rank
                )
                shards = SavedShards(root, 5, layout, lambda n: R.split_rule(n, cfg))
                got, _ = read_rank_state(shards, target, with_optimizer=False)
                where = (tp, ep, tp_rank, ep_rank)
                for name, tensor in expected.items():
                    want = tensor.chunk(ep)[ep_rank] if name in experts else tensor
                    assert torch.equal(got[name], want), (where, name)
                name = min(experts)
                assert target.first_element(name) == ep_rank * got[name].numel()
                assert target.first_element(router[0]) == 0


def test_missing_shard_and_other_model_shape_are_named(saved_tp2_pp2, tmp_path):
    cfg, full, root = saved_tp2_pp2
    layout = read_layout(root, 5)
    shards = SavedShards(root, 5, layout, lambda n: R.split_rule(n, cfg))
    wide = dataclasses.replace(cfg, hidden_size=64)
    target, _ = _target(wide, _full_state(wide), 1, 1, 0, 0)
    with pytest.raises(CheckpointError, match="the model shape differs from the checkpoint's"):
        read_rank_state(shards, target, with_optimizer=False)
    root = str(tmp_path / "copy")
    shutil.copytree(saved_tp2_pp2[2], root)
    os.remove(os.path.join(checkpoint_dir(root, 5), "mp_rank_01_001", "model_optim_rng.pt"))
    shards = SavedShards(root, 5, layout, lambda n: R.split_rule(n, cfg))
    target, _ = _target(cfg, full, 1, 1, 0, 0)
    with pytest.raises(CheckpointError, match="missing checkpoint shard .*mp_rank_01_001"):
        read_rank_state(shards, target, with_optimizer=False)


def test_a_layout_record_from_a_newer_version_is_refused(saved_tp2_pp2, tmp_path):
    _, _, root = saved_tp2_pp2
    assert read_layout(root, 5).ep == 1  # the record names EP (the converter writes EP 1)
    marker = Path(checkpoint_dir(root, 5)) / MARKER_NAME
    record = json.loads(marker.read_text())
    record["layout"]["version"] = 2
    original = marker.read_text()
    try:
        marker.write_text(json.dumps(record))
        with pytest.raises(LayoutVersionError, match="layout version 2, but this code reads"):
            read_layout(root, 5)
    finally:
        marker.write_text(original)


def _edit_layout_record(root, tmp_path, **fields) -> str:
    """A copy of the checkpoint at `root` whose marker's layout record has `fields` changed."""
    copy = str(tmp_path / "edited")
    shutil.copytree(root, copy)
    marker = Path(checkpoint_dir(copy, 5)) / MARKER_NAME
    record = json.loads(marker.read_text())
    record["layout"].update(fields)
    marker.write_text(json.dumps(record))
    return str(marker)


def test_a_layout_record_that_lies_or_has_a_string_version_is_named(saved_tp2_pp2, tmp_path):
    _, _, root = saved_tp2_pp2
    marker = _edit_layout_record(root, tmp_path / "tp1", tensor_model_parallel_size=1)
    with pytest.raises(CheckpointError) as err:  # not a raw `size mismatch` at load_state_dict
        read_layout(str(tmp_path / "tp1" / "edited"), 5)
    msg = str(err.value)
    assert msg.startswith(f"{marker}: its layout record says TP1 x PP2") and "TP2 x PP2" in msg
    assert "mp_rank_01_001" in msg
    marker = _edit_layout_record(root, tmp_path / "str", version="1")
    with pytest.raises(CheckpointError) as err:
        read_layout(str(tmp_path / "str" / "edited"), 5)
    msg = str(err.value)
    assert msg.startswith(f"{marker}: its layout record's version is '1' (str)"), msg
    assert "newer version" not in msg and not isinstance(err.value, LayoutVersionError)


def test_the_layout_record_carries_ep_and_the_resume_line_names_an_ep_change(tmp_path):
    from megatron.checkpoint.reshard_load import SavedLayout
    from megatron.training.reshard import same_shard_changes

    ep2 = SavedLayout(tp=2, pp=1, dp=4, cp=1, optimizer="distributed", ep=2)
    assert ep2.record()["expert_model_parallel_size"] == 2
    assert ep2.describe() == "TP2 x PP1 x DP4 x EP2, distributed optimizer"
    ep4 = dataclasses.replace(ep2, ep=4)
    assert same_shard_changes(ep2, ep2, with_optim=True) == []
    assert same_shard_changes(ep2, ep4, with_optim=True) == [
        "same model shards",
        "experts re-cut from EP2 to EP4",
    ]
    dp2 = dataclasses.replace(ep2, dp=2)
    assert same_shard_changes(ep2, dp2, with_optim=True) == [
        "same model shards",
        "optimizer state re-cut over DP",
    ]
    # A record from before EP was recorded (version 1 without the key) reads as unknown EP
    # and is not taken for a change; a record without DP says nothing.
    older = dataclasses.replace(ep2, ep=None)
    assert same_shard_changes(older, ep4, with_optim=True) == []
    assert same_shard_changes(dataclasses.replace(ep2, dp=None), ep4, with_optim=True) == []
