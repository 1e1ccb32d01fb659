"""--reset-attention-mask by cu_seqlens (model/attention/varlen.py): the documents of known ids,
SDPA once per document on the CPU against the block-diagonal mask, the (b, 1, s, s) mask never
built on that path, each document of a packed micro batch scored and differentiated as if it ran
alone (RoPE positions restarting), and the log line that says which path runs."""

import pytest
import torch
import torch.nn.functional as F

from megatron.config.cli import parse_args
from megatron.fused_kernels import FusedOps
from megatron.model.attention import masks
from megatron.model.attention.backends import choose_backend
from megatron.model.attention.core import CoreAttention
from megatron.model.attention.varlen import VARLEN, varlen_mask
from megatron.model.attention.varlen_cuda import varlen_report
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from megatron.training.data import DocumentMasking, document_fields
from tests.helpers.attention import document_ids
from tests.helpers.models import tiny_gpt

EOD = 9


def test_documents_of_known_ids():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    docs = varlen_mask(ids).data
    # flattened over the batch: a sample's start starts a document
    assert docs.bounds == [0, 3, 5, 6, 7, 12]
    assert docs.cu_seqlens.dtype == torch.int32 and docs.cu_seqlens.tolist() == docs.bounds
    assert docs.lengths() == [3, 2, 1, 1, 5] and docs.max_seqlen == 5
    keep = varlen_mask(ids).dense(6, 6, "cpu")  # every other backend's block-diagonal mask
    assert torch.equal(keep, masks.document_attention_mask(ids))
    with pytest.raises(ValueError, match="covers 6 positions; 1 queries"):
        varlen_mask(ids).dense(1, 6, "cpu")
    with pytest.raises(ValueError, match="document ids must not decrease along a sample"):
        varlen_mask(torch.tensor([[0, 0, 1, 0]])).data.lengths()
    with pytest.raises(ValueError, match="carries VarlenDocuments"):
        masks.AttentionMask(VARLEN, data=ids)


def _core(backend="sdpa", dropout=0.0):
    return CoreAttention(BuildContext(ops=FusedOps(attention_backend=backend)), dropout)


@pytest.mark.parametrize("lengths", [((3, 5, 18, 2, 4), (2, 6, 18, 3, 3)), ((32,), (1,) * 32)])
def test_sdpa_per_document_equals_the_block_diagonal_mask(lengths, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask, ids = varlen_mask(document_ids(lengths)), document_ids(lengths)
    core = _core()
    assert choose_backend(core, mask, q).name == "sdpa per document"
    assert choose_backend(_core("unfused"), mask, q).name == "softmax"  # the dense keep
    expected = F.scaled_dot_product_attention(q, k, v, masks.document_attention_mask(ids))

    def no_dense(*_):
        raise AssertionError("the (b, 1, s, s) mask was built")

    monkeypatch.setattr(masks, "document_attention_mask", no_dense)
    torch.testing.assert_close(core(q, k[:, :2], v[:, :2], mask), _gqa(q, k, v, ids))
    torch.testing.assert_close(core(q, k, v, mask), expected)


def _gqa(q, k, v, ids):
    """The reference with two key/value heads, each shared by two query heads."""
    k, v = (t[:, :2].repeat_interleave(2, dim=1) for t in (k, v))
    keep = (ids.unsqueeze(2) == ids.unsqueeze(1)) & torch.ones(32, 32, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, keep.unsqueeze(1))


# Three documents, each ended by its EOD, packed into two samples in different orders; positions
# restart at each document (--reset-position-ids), so RoPE sees each as if alone.
DOCS = [[1, 2, 3, 4, EOD], [5, 6, 7, 8, 10, 11, EOD], [12, 13, 14, EOD]]
ORDERS = [(0, 1, 2), (2, 0, 1)]
ALL = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def test_each_packed_document_scores_and_differentiates_as_if_alone(monkeypatch):
    cfg = tiny_gpt(position_embedding_type="rope", num_query_groups=2, vocab_size=16)
    model = GPTModel(cfg, BuildContext(seed=3, dtype=torch.float64))
    text = torch.tensor([sum((DOCS[d] for d in order), []) + [0] for order in ORDERS])
    tokens, labels = text[:, :-1], text[:, 1:]
    f = document_fields(tokens, ALL)
    monkeypatch.setattr(masks, "document_attention_mask", None)  # never built on this path
    packed = model(tokens, f["position_ids"], labels, document_ids=f["document_ids"])
    alone = [model(torch.tensor([d]), labels=torch.tensor([d[1:] + [0]]))[0] for d in DOCS]
    for row, order in enumerate(ORDERS):
        start = 0
        for d in order:
            n = len(DOCS[d]) - 1  # the tokens before its EOD: their labels are its own
            torch.testing.assert_close(packed[row, start : start + n], alone[d][:n])
            start += n + 1
    (packed * f["loss_mask"]).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    sum(len(ORDERS) * a[: len(d) - 1].sum() for a, d in zip(alone, DOCS, strict=True)).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, msg=k)


def test_the_log_says_which_path_runs_the_documents():
    base = ["--vocab-size", "16", "--tokenizer-type", "NullTokenizer", "--reset-attention-mask"]
    cfg = parse_args(base)
    sdpa, unfused = FusedOps(), FusedOps(attention_backend="unfused")
    line = varlen_report(cfg, sdpa, 1, torch.float32, "cpu")
    assert line.endswith("varlen by cu_seqlens, SDPA once per document on cpu")
    assert "ring attention within documents" in varlen_report(cfg, sdpa, 2, torch.float32, "cpu")
    assert "masked softmax" in varlen_report(cfg, unfused, 1, torch.float32, "cpu")
    compiled = parse_args([*base, "--torch-compile"])
    assert "--torch-compile" in varlen_report(compiled, sdpa, 1, torch.float32, "cpu")
    assert varlen_report(parse_args(base[:-1]), sdpa, 1, torch.float32, "cpu") is None
