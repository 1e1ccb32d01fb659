"""Context parallelism (--context-parallel-size): the rules, the load-balanced split, ring
attention against plain causal attention, and the GPT trained at CP against one process.

Ranks are gloo processes on the CPU. The multi-rank checks are grouped into few spawns (each
spawn runs several layouts and checks), all marked slow.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema import ModelConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.model.attention.standard import ParallelAttention
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.model.transformer import TransformerLayer
from megatron.models.gpt.model import GPTModel
from megatron.models.gpt.train import lm_loss
from megatron.mpu.context_parallel import (
    RingAttention,
    chunk_ids,
    context_parallel_positions,
    context_parallel_slice,
    context_parallel_unslice,
    gather_documents,
)
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.mpu.ring_documents import BlockKind, RingDocuments
from megatron.training.data import DocumentMasking, collate, get_batch
from tests.helpers.attention import LAYOUTS, PACKED, document_attention, document_ids
from tests.helpers.distributed import run_distributed
from tests.helpers.training import _losses, _ref_worker, _train, flags, train_run

# ---- the rules ----

_BASE_ARGV = ["--vocab-size", "64", "--seq-length", "16"]


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (["--seq-length", "18"], 4, "not divisible by 2 x CP = 4"),
        (["--context-parallel-size", "3"], 4, "world size 4 is not divisible by TP x CP x PP"),
        (["--deepspeed"], 4, "given with --deepspeed"),
        (["--attention-backend", "fused"], 2, "given with --attention-backend fused"),
        (
            ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "20"],
            8,
            "not divisible by --tensor-model-parallel-size 4",
        ),
        (["--context-parallel-size", "0"], 1, "must be >= 1"),
    ],
)
def test_bad_context_parallel_layouts_fail_before_any_work(extra, world, message):
    argv = [*_BASE_ARGV, "--context-parallel-size", "2", *extra]
    with pytest.raises(ConfigError, match=message) as err:
        parse_args(argv, world_size=world)
    text = str(err.value)
    assert text.startswith(("--context-parallel-size:", "--sequence-parallel:")), text
    assert "Fix:" in text


def test_context_parallel_divides_the_world_before_data_parallelism():
    cfg = parse_args([*_BASE_ARGV, "--context-parallel-size", "2"], world_size=8)
    assert cfg.parallel.context_parallel_size == 2
    assert cfg.parallel.data_parallel_size == 4
    cfg = parse_args(
        [*_BASE_ARGV, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2"],
        world_size=8,
    )
    assert cfg.parallel.data_parallel_size == 2


def test_context_parallel_takes_document_masks():
    docs = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    argv = [*_BASE_ARGV, "--context-parallel-size", "2", *docs]
    cfg = parse_args([*argv, "--tokenizer-type", "GPT2BPETokenizer"], world_size=2)
    assert cfg.data.reset_attention_mask and cfg.parallel.context_parallel_size == 2


def test_bert_refuses_context_parallelism():
    from megatron.config.rules import validate

    cfg = parse_args([*_BASE_ARGV, "--context-parallel-size", "2"], world_size=2)
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        validate(cfg, "eval-bert")


# ---- the load-balanced split ----


def test_load_balanced_split_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    seq = torch.arange(16).expand(2, 16)  # (b, s)
    parts = [context_parallel_slice(seq, r, 4) for r in range(4)]
    assert parts[0].tolist()[0] == [0, 1, 14, 15]
    assert parts[3].tolist()[0] == [6, 7, 8, 9]
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert torch.equal(context_parallel_unslice(parts), seq)
    assert torch.equal(context_parallel_positions(2, 16, 1, 4, "cpu"), parts[1])
    # causal work (keys seen) is equal on every rank
    work = [sum(int(t) + 1 for t in p[0]) for p in parts]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="not divisible"):
        context_parallel_slice(torch.zeros(1, 10), 0, 4)


# ---- the model at CP (x TP with SP) against one process: one spawn of 4 ranks ----

_MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=61,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
_LLAMA = dataclasses.replace(
    _MODEL,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=2,  # GQA: 2 query heads per key/value head
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)
_FULL = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
_SELECTIVE = RecomputeConfig(granularity="selective")


def _gather_cp(x: torch.Tensor, state, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(state.cp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.cp_group)
    return context_parallel_unslice(parts, dim)


def _check_ring_attention(state) -> None:
    """Ring attention (MHA and GQA) vs SDPA's causal attention over the whole sequence, its
    blocks through the explicit math and the CPU flash kernel (fp32, and bf16 loosely)."""
    g = torch.Generator().manual_seed(11)
    b, h, s, d = 2, 4, 8 * state.cp_size, 8
    cases = [(4, "math", torch.float32), (2, "math", torch.float32)]
    cases += [
        (4, "fused", torch.float32),
        (2, "fused", torch.float32),
        (2, "fused", torch.bfloat16),
    ]
    for groups, backend, dtype in cases:
        q = torch.randn(b, h, s, d, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(b, groups, s, d, generator=g).to(dtype).requires_grad_() for _ in "kv")
        dout = torch.randn(b, h, s, d, generator=g).to(dtype)
        rep = h // groups
        ref = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )
        ref.backward(dout)
        mine = [
            context_parallel_slice(t.detach(), state.cp_rank, state.cp_size, dim=2)
            .clone()
            .requires_grad_()
            for t in (q, k, v)
        ]
        ring = RingAttention(state, backend)
        assert ring.blocks(mine[0]).name == ("math" if backend == "math" else "cpu-flash")
        out = ring(*mine)
        out.backward(context_parallel_slice(dout, state.cp_rank, state.cp_size, dim=2))
        tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
        what = f"{backend} {dtype} groups={groups}"
        torch.testing.assert_close(_gather_cp(out.detach(), state, 2), ref.detach(), **tol)
        for name, full, local in zip("qkv", (q, k, v), mine, strict=True):
            grad = _gather_cp(local.grad, state, 2)
            torch.testing.assert_close(grad, full.grad, **tol, msg=f"{what} d{name}")


def _check_ring_attention_documents(state) -> None:
    """Ring attention within documents vs SDPA with the single-process (s, s) document mask:
    packed documents crossing chunk boundaries, chunks inside one document, pairs of chunks
    skipped and rows with no key in a block; one sample a whole document beside many short
    ones; every token its own document. Math and fused blocks, MHA and GQA, fp32 and bf16."""
    g = torch.Generator().manual_seed(12)
    cases = [(4, "math", torch.float32), (2, "fused", torch.float32)]
    cases += [(2, "fused", torch.bfloat16)]
    kinds = RingDocuments.from_sequence(document_ids(PACKED), state.cp_size).kinds
    assert {k for row in kinds for k in row} == set(BlockKind), kinds
    for layout, lengths in LAYOUTS.items():
        ids = document_ids(lengths)
        local_ids = context_parallel_slice(ids, state.cp_rank, state.cp_size)
        documents = gather_documents(local_ids, state)
        whole = RingDocuments.from_sequence(ids, state.cp_size)
        assert torch.equal(documents.chunks, whole.chunks) and documents.kinds == whole.kinds
        (b, s), h = ids.shape, 4
        for groups, backend, dtype in cases:
            q = torch.randn(b, h, s, 8, generator=g).to(dtype).requires_grad_()
            k, v = (
                torch.randn(b, groups, s, 8, generator=g).to(dtype).requires_grad_() for _ in "kv"
            )
            dout = torch.randn(b, h, s, 8, generator=g).to(dtype)
            ref = document_attention(q, k, v, ids)
            ref.backward(dout)
            mine = [
                context_parallel_slice(t.detach(), state.cp_rank, state.cp_size, dim=2)
                .clone()
                .requires_grad_()
                for t in (q, k, v)
            ]
            out = RingAttention(state, backend)(*mine, documents=documents)
            out.backward(context_parallel_slice(dout, state.cp_rank, state.cp_size, dim=2))
            tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
            what = f"{layout} {backend} {dtype} groups={groups}"
            torch.testing.assert_close(
                _gather_cp(out.detach(), state, 2), ref.detach(), **tol, msg=what
            )
            for name, full, local in zip("qkv", (q, k, v), mine, strict=True):
                grad = _gather_cp(local.grad, state, 2)
                torch.testing.assert_close(grad, full.grad, **tol, msg=f"{what} d{name}")


def _micro_batch(cfg: ModelConfig, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    text = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return text[:, :-1], text[:, 1:]


_EOD = 60  # the end-of-document token of the packed samples (vocab 61)


def _document_batch(cfg: ModelConfig, step: int, lengths, state):
    """A micro batch of the packed documents `lengths` (an EOD ends each) through the trainer's
    data path: --reset-position-ids, --reset-attention-mask and --eod-mask-loss fields (collate),
    this rank's chunks of each (get_batch)."""
    g = torch.Generator().manual_seed(1000 + step)
    text = torch.randint(0, _EOD, (len(lengths), cfg.seq_length + 1), generator=g)
    ends = torch.tensor([list(np.cumsum(n) - 1) for n in lengths])  # (b, documents)
    text.scatter_(1, ends, _EOD)
    documents = DocumentMasking(_EOD, True, True, True)
    batch = collate(documents, [{"text": row} for row in text])
    assert torch.equal(batch["document_ids"], document_ids(lengths))
    return get_batch(iter([batch]), torch.device("cpu"), state)


def _train_steps(model, state, steps: int, documents=None):
    """Reported losses, first-step gradients (reduced as the trainer reduces them: summed over
    TP for SP-marked parameters, averaged over CP) and the model after `steps` AdamW steps.
    `documents`: per-sample document lengths of packed samples (model inputs and loss mask from
    the trainer's document options)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    cp = state if state.cp_size > 1 else None
    losses, first = [], None
    for step in range(steps):
        if documents is not None:
            batch = _document_batch(model.cfg, step, documents, state)
            output = model(
                batch.tokens,
                position_ids=batch.position_ids,
                labels=batch.labels,
                document_ids=batch.document_ids,
            )
            mask = batch.loss_mask
        else:
            tokens, labels = _micro_batch(model.cfg, step)
            mask = torch.ones(labels.shape)
            if cp is not None:
                tokens, labels, mask = (
                    context_parallel_slice(t, state.cp_rank, state.cp_size)
                    for t in (tokens, labels, mask)
                )
            output = model(tokens, labels=labels)
        loss, stats = lm_loss(mask, output, context_parallel=cp)
        loss.backward()
        if state.sequence_parallel:
            mpu.all_reduce_sequence_parallel_grads(model.parameters(), state.tp_group, attr="grad")
        if cp is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=state.cp_group)
                p.grad /= state.cp_size
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(stats["lm loss"]))
    return losses, first


def _tracker(state):
    from megatron.initialize import set_random_seeds

    return set_random_seeds(5, state, "cpu")


def _gpt(cfg, state, recompute=None, tracker=None):
    """The GPT of `cfg` on this rank's grid (seed 5), recompute applied after building."""
    model = GPTModel(cfg, BuildContext(state, seed=5, rng_tracker=tracker))
    return parallelize(model, state, recompute)


def _shard(full, param, state):
    if not mpu.is_tensor_parallel(param):
        return full
    return mpu.shard(
        full, param.partition_dim, state.tp_rank, state.tp_size, param.partition_stride
    )


def _check_model_equivalence(state, variants) -> None:
    for name, (cfg, recompute, documents) in variants.items():
        ref = _gpt(cfg, mpu.single_process_state(), recompute)
        ref_losses, ref_grads = _train_steps(ref, ref.state, 3, documents)
        model = _gpt(cfg, state, recompute, _tracker(state))
        probe = torch.empty(1, 1, 2, cfg.head_dim)
        for layer in model.modules():  # --attention-backend sdpa: the fused CPU kernel
            if isinstance(layer, ParallelAttention):
                assert layer.ring.blocks(probe).name == "cpu-flash", name
        losses, grads = _train_steps(model, state, 3, documents)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)
        full = dict(ref.named_parameters())
        for pname, p in model.named_parameters():
            torch.testing.assert_close(
                grads[pname],
                _shard(ref_grads[pname], p, state),
                rtol=1e-4,
                atol=1e-6,
                msg=f"{name} {pname} grad",
            )
            torch.testing.assert_close(
                p.detach(),
                _shard(full[pname].detach(), p, state),
                rtol=1e-4,
                atol=1e-5,
                msg=f"{name} {pname}",
            )


def _check_dropout_under_recompute(state) -> None:
    """Attention and residual dropout at CP: other masks on other CP ranks; no, full and
    selective recompute give the same losses and gradients bit for bit (masks replayed, the
    ring's backward redrawing its blocks' masks from the forward's generator state)."""
    cfg = dataclasses.replace(_LLAMA, hidden_dropout=0.2, attention_dropout=0.2)
    layer = TransformerLayer(cfg, BuildContext(state, rng_tracker=_tracker(state)))
    mask = (layer._dropout(torch.ones(2, 8, 32)) == 0).contiguous()
    masks = [torch.empty_like(mask) for _ in range(state.cp_size)]
    dist.all_gather(masks, mask, group=state.cp_group)
    assert not torch.equal(masks[0], masks[1]), "CP ranks drew the same residual dropout mask"
    runs = []
    for recompute in (None, _FULL, _SELECTIVE):
        torch.manual_seed(3 + 10_000 * state.cp_rank)
        model = _gpt(cfg, state, recompute, _tracker(state))
        runs.append(_train_steps(model, state, 2))
    (l0, g0), *others = runs
    for losses, grads in others:
        assert losses == l0, "recompute changed the losses under dropout with CP"
        for n in g0:
            assert torch.equal(g0[n], grads[n]), n
    no_dropout, _ = _train_steps(_gpt(_LLAMA, state, tracker=_tracker(state)), state, 2)
    assert no_dropout != l0, "dropout 0.2 must change the losses"


_CP_VARIANTS = {
    "gpt2": (_MODEL, None, None),
    "RoPE, GQA, RMSNorm, SwiGLU, full recompute": (_LLAMA, _FULL, None),
    "RoPE, GQA, selective recompute": (_LLAMA, _SELECTIVE, None),
    # packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss)
    "gpt2, documents": (dataclasses.replace(_MODEL, seq_length=32), None, PACKED),
    "RoPE, GQA, documents, selective recompute": (
        dataclasses.replace(_LLAMA, seq_length=32),
        _SELECTIVE,
        PACKED,
    ),
}
_DOCS = ["gpt2, documents", "RoPE, GQA, documents, selective recompute"]


def _model_worker(rank, world):
    torch.manual_seed(0)
    for tp, cp, sp, names in (
        (1, 4, False, [*_CP_VARIANTS][:3] + _DOCS[:1]),
        (1, 2, False, [*_CP_VARIANTS][:2] + _DOCS[1:]),  # CP 2 x DP 2: each CP pair checks itself
        (2, 2, True, [*_CP_VARIANTS][1:2] + _DOCS[1:]),
    ):
        state = initialize_model_parallel(tp, context_parallel_size=cp, sequence_parallel=sp)
        _check_ring_attention(state)
        if tp == 1:  # 8 and 4 chunks
            _check_ring_attention_documents(state)
        _check_model_equivalence(state, {n: _CP_VARIANTS[n] for n in names})
        if cp == 2 and tp == 1:
            _check_dropout_under_recompute(state)
        destroy_model_parallel(state)
    return True


@pytest.mark.slow
def test_context_parallel_model_matches_one_process():
    """Ring attention (MHA, GQA) vs SDPA, also within packed documents; the GPT at CP 4, CP 2
    (x DP 2) and CP 2 x TP 2 with SP vs one process: losses, first-step gradients, weights
    after 3 AdamW steps (learned and RoPE positions, GQA, full and selective recompute, packed
    documents with --reset-attention-mask / --reset-position-ids / --eod-mask-loss); dropout
    under recompute at CP 2."""
    assert run_distributed(_model_worker, 4) == [True] * 4


# ---- the trainer: CP 2 x PP 2 x DP 2 vs one process; a CP 2 checkpoint resumed at CP 1, 4 ----


def _layout(cp: int, pp: int = 2) -> list[str]:
    return ["--context-parallel-size", str(cp), "--pipeline-model-parallel-size", str(pp)]


def _iters(argv: list[str], n: int) -> list[str]:
    out = list(argv)
    out[out.index("--train-iters") + 1] = str(n)
    return out


def _cp_worker(rank, world, argv, ref_weights, save_dir):
    """CP 2 x PP 2 x DP 2 (distributed optimizer): 6 iterations straight, its weights against
    one process'; 3 iterations saved, resumed at CP 1 (DP 4) and at CP 4 (DP 1) to 6."""
    result = train_run(rank, world, argv + _layout(2))
    straight, model = result.history, result.model.module
    assert model.chunks[0].state.cp_size == 2
    for chunk in model.chunks:
        for name, p in chunk.named_parameters():
            expected = torch.from_numpy(ref_weights[name])
            torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-5, msg=name)
    _train(rank, world, _iters(argv, 3) + _layout(2) + ["--save", save_dir])
    resumed = {
        cp: _train(rank, world, argv + _layout(cp) + ["--load", save_dir])[0] for cp in (1, 4)
    }
    return straight, resumed


_TRAIN_FLAGS = (
    "--num-layers",
    "4",
    "--adam-eps",
    "1e-4",
    "--position-embedding-type",
    "rope",
    "--num-query-groups",
    "2",
    "--use-distributed-optimizer",
)


@pytest.mark.slow
def test_context_parallel_training_matches_one_process_and_resumes_at_other_cp(
    data_prefix,
    tmp_path,
):
    """pretrain() at CP 2 x PP 2 x DP 2 with RoPE, GQA and the distributed optimizer (sharded
    over DP x CP): losses, grad norms and final weights of one process; its checkpoint resumes
    at CP 1 and CP 4 to the uninterrupted losses."""
    argv = flags(data_prefix, *_TRAIN_FLAGS)
    ((ref, ref_weights),) = run_distributed(_ref_worker, 1, argv)
    results = run_distributed(_cp_worker, 8, argv, ref_weights, str(tmp_path / "ck"))
    for rank, (straight, resumed) in enumerate(results):
        np.testing.assert_allclose(_losses(straight), _losses(ref), rtol=2e-5, err_msg=f"{rank}")
        np.testing.assert_allclose(
            [h["grad_norm"] for h in straight], [h["grad_norm"] for h in ref], rtol=1e-4
        )
        for cp, history in resumed.items():
            assert len(history) == 3, cp
            np.testing.assert_allclose(
                _losses(history), _losses(ref)[3:], rtol=2e-5, err_msg=f"resumed at CP {cp}"
            )
