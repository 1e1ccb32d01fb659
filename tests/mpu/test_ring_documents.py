"""Ring attention's document masks (mpu/ring_documents.py) in one process: which chunk pairs
are skipped, run as without documents or masked; the masked math and the LSE merge on rows
that see no key; a masked block's pieces (mpu/ring_pieces.py) against its keep mask and the
masked math; and every query chunk's blocks, run and merged as the ring runs them, against
attention within documents over the whole sequence. The ring itself (CP ranks) is checked in
tests/mpu/test_context_parallel.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.mpu import context_parallel as cp
from megatron.mpu import ring_blocks as rb
from megatron.mpu import ring_pieces as rp
from megatron.mpu.ring_documents import BlockKind, RingDocuments, _diagonal_spans, causal_kind
from tests.helpers.attention import (
    LAYOUTS,
    MIXED,
    PACKED,
    SINGLETONS,
    document_attention,
    document_ids,
)

S, F, C, M = BlockKind.SKIP, BlockKind.FULL, BlockKind.CAUSAL, BlockKind.MASKED
CPU = torch.device("cpu")


def test_chunk_pairs_are_skipped_full_causal_or_masked():
    # 8 chunks of 4: sample 0 is 0001 1111 2222 2222 2222 2222 2233 4444
    kinds = RingDocuments.from_sequence(document_ids(PACKED[:1]), 4).kinds
    assert kinds[1][0] == M and kinds[0][0] == M  # document 1 crosses the boundary
    assert kinds[2][1] == S and kinds[7][6] == S  # earlier keys, no document in common
    assert kinds[3][2] == F and kinds[5][2] == F and kinds[3][3] == C  # inside document 2
    assert kinds[6][5] == M and kinds[6][6] == M and kinds[7][7] == C
    assert all(kinds[i][j] == S for i in range(8) for j in range(i + 1, 8))  # the future
    # both samples (sample 1: 0011 1111 2222 2222 2222 2222 2233 3444): a pair is FULL / SKIP
    # only where it is in each sample
    both = RingDocuments.from_sequence(document_ids(PACKED), 4).kinds
    assert both[7][6] == M and both[2][1] == S and both[3][2] == F and both[7][7] == M
    one = RingDocuments.from_sequence(document_ids(((32,), (32,))), 4).kinds
    assert one == tuple(tuple(causal_kind(i, j) for j in range(8)) for i in range(8))
    mixed = RingDocuments.from_sequence(document_ids(MIXED), 2).kinds
    assert {k for row in mixed for k in row} == {S, M}
    alone = RingDocuments.from_sequence(document_ids(SINGLETONS), 2).kinds
    assert all(alone[i][j] == (M if i == j else S) for i in range(4) for j in range(4))
    with pytest.raises(ValueError, match="do not split into 2 x CP = 6"):
        RingDocuments.from_sequence(document_ids(PACKED), 3)


def test_block_keep_mask_is_causal_within_documents():
    docs = RingDocuments.from_sequence(document_ids(PACKED[:1]), 4)
    # chunk 6 (ids 2 2 3 3) against chunk 5 (2 2 2 2): the rows of document 3 see nothing
    assert docs.keep(6, 5)[0, 0].int().tolist() == [[1] * 4, [1] * 4, [0] * 4, [0] * 4]
    diagonal = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert docs.keep(6, 6)[0, 0].int().tolist() == diagonal
    assert docs.keep(1, 0)[0, 0].int().tolist() == [[0, 0, 0, 1]] * 4
    assert not docs.keep(0, 1).any()


def test_masked_math_and_merge_leave_rows_without_keys_at_zero_not_nan():
    """A masked block whose rows 0 and 2 see no key: LSE -inf, out 0; merged with another such
    block they stay so; merged with the diagonal they equal attention over both blocks, and
    the backward from the merged result matches autograd, with no NaN anywhere."""
    g = torch.Generator().manual_seed(2)
    q, k0, v0, k1, v1, dout = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(6))
    scale = 1 / math.sqrt(8)
    keep0 = torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]]).bool()
    keep0 = keep0.view(1, 1, 4, 4)
    out0, lse0, _ = rb.block_step(rb.MATH, q, k0, v0, scale, False, 0.0, keep0)
    assert torch.isneginf(lse0[..., [0, 2]]).all() and not torch.isnan(lse0).any()
    assert torch.equal(out0[..., [0, 2], :], torch.zeros(1, 2, 2, 8))
    empty, lse_empty = cp._merge(
        out0, lse0, torch.zeros_like(out0), torch.full_like(lse0, -math.inf)
    )
    assert torch.equal(empty, out0) and torch.equal(lse_empty, lse0)
    both, _ = cp._merge(out0, lse0, torch.zeros_like(out0), lse0)  # -inf with -inf
    assert not torch.isnan(both).any() and torch.equal(both[..., [0, 2], :], out0[..., [0, 2], :])
    out1, lse1, _ = rb.block_step(rb.MATH, q, k1, v1, scale, True, 0.0)
    out, lse = cp._merge(out0, lse0, out1, lse1)
    # the reference: both blocks as one row of 8 keys
    keep = torch.cat([keep0, torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()], -1)
    qa, ka, va = (
        t.clone().requires_grad_() for t in (q, torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
    )
    ref = torch.nn.functional.scaled_dot_product_attention(qa, ka, va, attn_mask=keep)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach())
    dq0, dk0, dv0 = rb.MATH.backward(q, k0, v0, dout, out, lse, scale, False, 0.0, None, keep=keep0)
    dq1, dk1, dv1 = rb.MATH.backward(q, k1, v1, dout, out, lse, scale, True, 0.0, None)
    for t in (dq0, dk0, dv0):
        assert not torch.isnan(t).any()
    torch.testing.assert_close(dq0 + dq1, qa.grad)
    torch.testing.assert_close(torch.cat([dk0, dk1], 2), ka.grad)
    torch.testing.assert_close(torch.cat([dv0, dv1], 2), va.grad)
    assert torch.equal(dk0[..., 3, :], torch.zeros(1, 2, 8))  # key 3: seen by no query


def _blocks_as_the_ring_runs_them(blocks, q, k, v, dout, docs: RingDocuments):
    """Every query chunk over every key chunk through the ring's per-block path (skipped,
    fused or masked by kind), merged by LSE, then each block's backward from the merged result.
    q, k, v, dout: whole sequences (b, h, s, d). Returns out, dq, dk, dv (fp32), and the kinds
    met."""
    n, c = docs.chunks.size(0), docs.chunk_length
    scale, dt = 1 / math.sqrt(q.size(-1)), blocks.dtype(q.dtype)
    piecewise = blocks is not rb.MATH
    qs, ks, vs, dos = (t.to(dt).split(c, 2) for t in (q, k, v, dout))
    outs, lses, ran, replays = [], [], set(), {}
    for i in range(n):
        out = lse = None
        for j in range(n):
            kind = docs.kind(i, j)
            ran.add(kind)
            if kind is S:
                continue
            mask = cp.masked_block(docs, i, j, piecewise) if kind is M else None
            o, s, replay = cp._block_forward(
                blocks, qs[i], ks[j], vs[j], scale, kind is C, 0.0, mask
            )
            replays[i, j] = replay
            out, lse = (o.float(), s) if out is None else cp._merge(out, lse, o.float(), s)
        outs.append(out)
        lses.append(lse)
    dq = [torch.zeros_like(o) for o in outs]
    dk, dv = ([torch.zeros(o.shape) for o in outs] for _ in "kv")
    for i in range(n):
        for j in range(n):
            kind = docs.kind(i, j)
            if kind is S:
                continue
            mask = cp.masked_block(docs, i, j, piecewise) if kind is M else None
            grads = cp._block_backward(
                blocks, qs[i], ks[j], vs[j], dos[i], outs[i].to(dt), lses[i], scale, kind is C,
                0.0, replays[i, j], mask,
            )  # fmt: skip
            for acc, g in zip((dq[i], dk[j], dv[j]), grads, strict=True):
                acc += g.float()
    return [torch.cat(t, 2) for t in (outs, dq, dk, dv)], ran


# an id that comes back after another: not contiguous runs, so masked blocks take the math
_RETURNING = torch.tensor([[0] * 6 + [1] * 4 + [0] * 6 + [2] * 16, [0] * 32])


@pytest.mark.parametrize("layout", [*LAYOUTS, "returning"])
@pytest.mark.parametrize("chunks", [4, 8])
@pytest.mark.parametrize("backend", ["math", "fused"])
def test_blocks_merged_by_kind_equal_attention_within_documents(layout, chunks, backend):
    g = torch.Generator().manual_seed(7)
    ids = _RETURNING if layout == "returning" else document_ids(LAYOUTS[layout])
    b, s = ids.shape
    q, k, v, dout = (torch.randn(b, 2, s, 8, generator=g) for _ in range(4))
    docs = RingDocuments.from_sequence(ids, chunks // 2)
    blocks = rb.select_blocks(backend, CPU, torch.float32, 8)
    (out, dq, dk, dv), ran = _blocks_as_the_ring_runs_them(blocks, q, k, v, dout, docs)
    if layout == "packed":
        assert ran == {S, F, C, M}, ran
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    ref = document_attention(qa, ka, va, ids)
    ref.backward(dout)
    for what, mine, want in (("out", out, ref), ("dq", dq, qa.grad), ("dk", dk, ka.grad)):
        torch.testing.assert_close(mine, want.detach(), rtol=1e-5, atol=1e-5, msg=what)
    torch.testing.assert_close(dv, va.grad, rtol=1e-5, atol=1e-5)


def _covered(pieces, b: int, c: int) -> torch.Tensor:
    """(b, 1, c, c) bool: the pairs a block's pieces compute."""
    mask = torch.zeros(b, 1, c, c, dtype=torch.bool)
    for piece in pieces:
        (r0, r1), (c0, c1) = piece.rows, piece.cols
        part = torch.ones(b if piece.index is None else len(piece.index), 1, r1 - r0, c1 - c0)
        if piece.causal:
            part = part.tril()
        if piece.keep is not None:
            part = piece.keep.float()
        region = mask[..., r0:r1, c0:c1]
        assert not region[piece.index if piece.index is not None else slice(None)].any()
        if piece.index is None:
            region |= part.bool()
        else:
            region[piece.index] = part.bool()
    return mask


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunks", [4, 8])
def test_pieces_of_a_masked_block_are_exactly_its_keep_mask(layout, chunks):
    """Off the diagonal one rectangle per sample (the document from the key chunk into the
    query chunk), on it a causal square per document or a tile of short ones; together,
    without overlap, exactly the block's keep mask."""
    docs = RingDocuments.from_sequence(document_ids(LAYOUTS[layout]), chunks // 2)
    b, c = docs.chunks.size(1), docs.chunk_length
    for i in range(chunks):
        for j in range(i + 1):
            if docs.kind(i, j) is M:
                pieces = docs.pieces(i, j)
                assert torch.equal(_covered(pieces, b, c), docs.keep(i, j)), (i, j)
                assert all(p.keep is None for p in pieces if p.rows != p.cols)
    # PACKED[0] at 8 chunks of 4 (0001 1111 2222 ...): chunk 1 over chunk 0 is document 1,
    # key 3 for every query row of sample 0; sample 1 (0011 1111) keys 2 and 3
    if layout == "packed" and chunks == 8:
        rects = {(tuple(p.index.tolist()), p.rows, p.cols) for p in docs.pieces(1, 0)}
        assert rects == {((0,), (0, 4), (3, 4)), ((1,), (0, 4), (2, 4))}


def test_short_documents_are_tiled_and_equal_boundaries_batched():
    # runs of a chunk: (start, end, id); SHORT = 4 and TILE = 32 tokens
    runs = [(0, 1, 0), (1, 3, 1), (3, 9, 2), (9, 10, 3), (10, 40, 4), (40, 41, 5)]
    runs += [(41 + 2 * n, 43 + 2 * n, 6 + n) for n in range(20)]  # 20 of 2 tokens: 2 tiles
    assert _diagonal_spans(runs) == [
        ((0, 3), True), ((3, 9), False), ((9, 10), False), ((10, 40), False),
        ((40, 71), True), ((71, 81), True),
    ]  # fmt: skip
    # two samples with the same documents: one kernel call per piece over both
    same = RingDocuments.from_sequence(document_ids((PACKED[0], PACKED[0])), 2)
    assert all(p.index is None for p in same.pieces(1, 1) + same.pieces(2, 1))
    assert len(same.pieces(1, 1)) == len(
        RingDocuments.from_sequence(document_ids(PACKED[:1]), 2).pieces(1, 1)
    )
    assert RingDocuments.from_sequence(_RETURNING, 2).pieces(1, 1) is None


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("groups", [2, 1])
def test_pieces_through_the_fused_kernel_equal_the_masked_math(layout, groups):
    """Every masked block of 4 and 8 chunks: out, LSE and, from the block's own out and LSE,
    dq, dk, dv of its pieces through the CPU flash kernel against the fp32 masked math."""
    g = torch.Generator().manual_seed(3)
    ids = document_ids(LAYOUTS[layout])
    fused = rb.select_blocks("fused", CPU, torch.float32, 8)
    for chunks in (4, 8):
        docs = RingDocuments.from_sequence(ids, chunks // 2)
        b, c = docs.chunks.size(1), docs.chunk_length
        masked = [(i, j) for i in range(chunks) for j in range(i + 1) if docs.kind(i, j) is M]
        for i, j in masked:
            q, dout = (torch.randn(b, 2, c, 8, generator=g) for _ in "qo")
            k, v = (torch.randn(b, groups, c, 8, generator=g).expand(b, 2, c, 8) for _ in "kv")
            keep, pieces = docs.keep(i, j), docs.pieces(i, j)
            out, lse, replays = rp.forward(fused, q, k, v, 0.3, 0.0, pieces)
            ref_out, ref_lse, _ = rb.block_step(rb.MATH, q, k, v, 0.3, False, 0.0, keep)
            grads = rp.backward(fused, q, k, v, dout, out, lse, 0.3, 0.0, replays, pieces)
            ref = rb.MATH.backward(q, k, v, dout, ref_out, ref_lse, 0.3, False, 0.0, None, keep)
            what = f"{layout} {chunks} chunks, pair {i, j}"
            torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6, msg=what)
            pairs = zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref), strict=True)
            for name, mine, want in pairs:
                torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=f"{what} {name}")
