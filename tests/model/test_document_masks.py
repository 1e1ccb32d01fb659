"""--reset-position-ids, --reset-attention-mask, --eod-mask-loss (Megatron v1.1.5's document
boundaries in packed samples): the fields from known tokens, each document of a packed sample
scored exactly as alone (every attention backend, learned and RoPE positions, recompute), and
TP x PP and DeepSpeed runs that equal one process."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (see conftest)

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402

import numpy as np
import pytest
import torch

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema import ModelConfig
from megatron.config.schema_kernels import KernelConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.fused_kernels import FusedOps, select_ops
from megatron.model.attention.masks import document_attention_mask
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel
from megatron.training.data import DocumentMasking, collate, document_fields, get_batch
from tests.helpers.distributed import run_distributed
from tests.helpers.training import _losses, _pp_worker, _ref_worker, _train, assert_same_run, flags

EOD = 9
ALL = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
DOC_FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def test_fields_from_known_tokens():
    tokens = torch.tensor([[1, 2, 9, 3, 4, 5, 9, 6], [9, 1, 2, 3, 9, 9, 4, 5]])
    f = document_fields(tokens, ALL)
    # An EOD belongs to the document it ends; positions restart right after it.
    assert f["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 2, 3, 3]]
    assert f["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 0, 0, 1]]
    assert f["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0, 1, 1]]
    keep = document_attention_mask(f["document_ids"])  # (b, 1, s, s)
    assert keep.shape == (2, 1, 8, 8) and keep.dtype == torch.bool
    seen = [[j for j in range(8) if keep[0, 0, i, j]] for i in range(8)]
    assert seen == [[0], [0, 1], [0, 1, 2], [3], [3, 4], [3, 4, 5], [3, 4, 5, 6], [7]]
    assert [j for j in range(8) if keep[1, 0, 5, j]] == [5]  # an empty document: EOD alone
    # Each option on its own gives only its field; none on: no fields at all.
    only = DocumentMasking(EOD, reset_position_ids=True)
    assert set(document_fields(tokens, only)) == {"position_ids"}
    assert DocumentMasking.from_config(parse_args(["--vocab-size", "8"]).data, EOD) is None


def test_masked_softmax_under_the_causal_mask_is_the_causal_softmax_bit_for_bit():
    # So a KV-cache step (a causal mask tensor) on the unfused backend computes what it did.
    from megatron.fused_kernels import TORCH_OPS

    scores = torch.randn(2, 3, 5, 7)
    keep = torch.ones(5, 7, dtype=torch.bool).tril(2)
    assert torch.equal(
        TORCH_OPS.masked_softmax(scores, keep, 0.3), TORCH_OPS.causal_softmax(scores, 0.3)
    )


def test_collate_and_get_batch_carry_the_fields_to_the_model_inputs():
    text = np.array([1, 2, 9, 3, 4, 5, 9, 6, 7])  # tokens = text[:-1], labels = text[1:]
    batch = get_batch(iter([collate(ALL, [{"text": text}, {"text": text[::-1].copy()}])]), "cpu")
    assert batch.tokens.tolist()[0] == [1, 2, 9, 3, 4, 5, 9, 6]
    assert batch.labels.tolist()[0] == [2, 9, 3, 4, 5, 9, 6, 7]
    assert batch.position_ids.tolist()[0] == [0, 1, 2, 0, 1, 2, 3, 0]
    assert batch.document_ids.tolist()[1] == [0, 0, 0, 1, 1, 1, 1, 2]  # 7 6 9 5 4 3 9 2
    assert batch.loss_mask.dtype == torch.float32 and batch.loss_mask.tolist()[0][2] == 0
    plain = get_batch(iter([collate(None, [{"text": text}])]), "cpu")
    assert plain.position_ids is None and plain.document_ids is None
    assert plain.loss_mask.tolist() == [[1.0] * 8]


def test_flags_need_a_tokenizer_for_the_end_of_document_id():
    for flag in DOC_FLAGS:
        with pytest.raises(ConfigError, match=f"{flag}: needs the end-of-document id"):
            parse_args(["--vocab-size", "8", flag])
    cfg = parse_args(["--vocab-size", "8", "--tokenizer-type", "NullTokenizer", *DOC_FLAGS])
    d = cfg.data
    assert d.reset_position_ids and d.reset_attention_mask and d.eod_mask_loss


# ---- each document of a packed sample scores as if it ran alone ----

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=16,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
ROPE = dataclasses.replace(CFG, position_embedding_type="rope", num_query_groups=2)
# Three documents, each ended by its EOD; two samples pack them in different orders.
DOCS = [[1, 2, 3, 4, EOD], [5, 6, 7, 8, 10, 11, EOD], [12, 13, 14, EOD]]
ORDERS = [(0, 1, 2), (2, 0, 1)]


def _ops(backend: str):
    if backend == "fused":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("Triton is not installed")
        # Triton's interpreter on the CPU (set at import, the test marked `triton`: conftest)
        off = {"layer_norm_fusion": False, "bias_gelu_fusion": False, "bias_swiglu_fusion": False}
        ops = select_ops(KernelConfig(attention_backend="fused", **off), "cpu")
        assert ops.softmax == "triton"  # only the softmax in Triton's (slow) interpreter
        return ops
    return FusedOps(attention_backend=backend)


def _packed_and_alone(model, documents=ALL):
    """Per-token losses of the packed samples (b, s) and of each document run alone."""
    text = torch.tensor([sum((DOCS[d] for d in order), []) + [0] for order in ORDERS])
    tokens, labels = text[:, :-1], text[:, 1:]
    f = document_fields(tokens, documents)
    packed = model(
        tokens,
        position_ids=f.get("position_ids"),
        labels=labels,
        document_ids=f.get("document_ids"),
    )
    alone = [model(torch.tensor([d]), labels=torch.tensor([d[1:] + [0]]))[0] for d in DOCS]
    return packed, alone, f.get("loss_mask", torch.ones_like(packed))


def _compare(packed, alone):
    """The losses of each document's tokens before its EOD (their labels are its own tokens)."""
    for row, order in enumerate(ORDERS):
        start = 0
        for d in order:
            n = len(DOCS[d]) - 1
            torch.testing.assert_close(packed[row, start : start + n], alone[d][:n], msg=f"{d}")
            start += n + 1


@pytest.mark.parametrize(
    "backend",
    ["sdpa", "unfused", pytest.param("fused", marks=[pytest.mark.slow, pytest.mark.triton])],
)
@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("cfg", [CFG, ROPE], ids=["learned", "rope"])
def test_each_packed_document_scores_as_if_alone(backend, cfg):
    model = GPTModel(cfg, BuildContext(seed=3, ops=_ops(backend)))
    packed, alone, loss_mask = _packed_and_alone(model)
    _compare(packed, alone)
    # Gradients too: the masked sum over the packed samples is the sum over the documents
    # alone, each counted once per sample that holds it (the EOD positions are masked out).
    (packed * loss_mask).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    sum(len(ORDERS) * a[: len(d) - 1].sum() for a, d in zip(alone, DOCS, strict=True)).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)
    if backend == "fused":
        return  # (Triton's interpreter is slow; the contrast below is the same for every path)
    # Without the options the later documents see the earlier ones: the losses differ.
    with pytest.raises(AssertionError):
        _compare(*_packed_and_alone(model, DocumentMasking(EOD))[:2])


@pytest.mark.slow  # over a second on 2 cores
def test_recompute_with_document_masks_changes_nothing():
    """Full (uniform, block) and selective recompute replay the masked attention exactly."""
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(mpu.MODEL_PARALLEL_RNG, 5)
    cfg = dataclasses.replace(ROPE, hidden_dropout=0.2, attention_dropout=0.2)
    results = []
    for rc in (None, *(RecomputeConfig(g, m, 1) for g, m in RECOMPUTE)):
        model = parallelize(
            GPTModel(cfg, BuildContext(seed=3, dtype=torch.float64, rng_tracker=tracker)),
            mpu.single_process_state(),
            rc,
        )
        torch.manual_seed(11)
        tracker.set_states({mpu.MODEL_PARALLEL_RNG: torch.Generator().manual_seed(5).get_state()})
        packed, _, loss_mask = _packed_and_alone(model)
        (packed * loss_mask).sum().backward()
        results.append((packed.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (l0, g0), *others = results
    for (l1, g1), kind in zip(others, RECOMPUTE, strict=True):
        assert torch.equal(l0, l1), kind
        for name in g0:
            assert torch.equal(g0[name], g1[name]), (kind, name)


RECOMPUTE = [("full", "uniform"), ("full", "block"), ("selective", "uniform")]


# ---- end to end: TP x PP and DeepSpeed equal one process ----

VOCAB = 127  # NullTokenizer: ids 0..126, and 127 is the end-of-document id


@pytest.fixture(scope="module")
def eod_data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("docs") / "toy"
    rng = np.random.default_rng(0)
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(300):  # short counting documents, each ended by its EOD (--append-eod)
        start, stride, n = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(2, 12)
        b.add_document([np.append((start + stride * np.arange(n)) % VOCAB, VOCAB)])
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def _argv(prefix, *extra):
    argv = flags(prefix, "--num-layers", "4", "--adam-eps", "1e-4", iters=3)
    i = argv.index("--vocab-size")
    argv[i + 1] = str(VOCAB)
    return argv + ["--tokenizer-type", "NullTokenizer", *extra]


def _ref_and_plain(rank, world, argv, plain_argv):
    ref = _ref_worker(rank, world, argv)
    return ref, _train(rank, world, plain_argv)[0]


def _layouts_worker(rank, world, argv, layouts, ref_weights):
    return {name: _pp_worker(rank, world, argv + layout, ref_weights)["history"]
            for name, layout in layouts.items()}  # fmt: skip


@pytest.mark.slow
def test_tp2_pp2_and_cp2_pp2_with_document_masks_equal_one_process(eod_data):
    """TP 2 x PP 2 (full recompute) and CP 2 x PP 2 (ring attention within documents, the
    16-token samples cut into 4 chunks that documents of 3 to 12 tokens cross) through
    pretrain(): losses, grad norms and final weights of one process."""
    argv = _argv(eod_data, *DOC_FLAGS, "--position-embedding-type", "rope")
    plain = _argv(eod_data, "--position-embedding-type", "rope")
    (((ref, ref_weights), without),) = run_distributed(_ref_and_plain, 1, argv, plain)
    assert not np.allclose(_losses(ref), _losses(without), rtol=1e-3), "the flags must act"
    pp = ["--pipeline-model-parallel-size", "2"]
    layouts = {
        "tp2 pp2": ["--tensor-model-parallel-size", "2", *pp, "--recompute-granularity", "full"],
        "cp2 pp2": ["--context-parallel-size", "2", *pp],
    }
    runs = run_distributed(_layouts_worker, 4, argv, layouts, ref_weights)
    for rank, histories in enumerate(runs):
        for name, history in histories.items():
            assert_same_run(history, ref, f"{name} rank {rank}")


def _ds_runs(rank, world, argv):
    ds = argv + ["--deepspeed", "--zero-stage", "1"]
    return {
        "native": _train(rank, world, argv)[0],
        "ds": _train(rank, world, ds)[0],
        "ds-pipe": _train(rank, world, ds + ["--pipeline-model-parallel-size", "2"])[0],
    }


@pytest.mark.slow
def test_deepspeed_engines_see_the_document_masks(eod_data):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    argv = _argv(eod_data, *DOC_FLAGS, "--checkpoint-activations")
    for rank, runs in enumerate(run_distributed(_ds_runs, 2, argv)):
        for name in ("ds", "ds-pipe"):
            np.testing.assert_allclose(
                _losses(runs[name]), _losses(runs["native"]), rtol=2e-5, err_msg=f"{name} {rank}"
            )
