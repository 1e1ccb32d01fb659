"""Every mpu piece against its single-process twin, on 4 gloo ranks at TP = 4 and TP = 2.

One spawn checks many things (starting ranks costs seconds); each check raises with its name.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.mpu.mappings import all_to_all
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _close(name, actual, expected):
    try:
        torch.testing.assert_close(actual, expected, **TOL)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}") from None


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _reference_linear(x, w, b, grad_out):
    """The unsharded twin: an nn.Linear holding w and b, and its input after a backward of
    grad_out (dL/dX in .grad)."""
    ref = nn.Linear(w.shape[1], w.shape[0], dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.bias.copy_(b)
    xr = x.clone().requires_grad_()
    ref(xr).backward(grad_out)
    return ref, xr


def _check_column(state):
    g = state.tp_group
    x, w, b = _randn(3, 5, 8, seed=1), _randn(12, 8, seed=2), _randn(12, seed=3)
    grad_out = _randn(3, 5, 12, seed=4)
    ref, xr = _reference_linear(x, w, b, grad_out)
    for gather in (True, False):
        layer = mpu.ColumnParallelLinear(
            8, 12, group=g, gather_output=gather, init_method=None, dtype=DT
        )
        mpu.copy_full_into_param(layer.weight, w, g)
        mpu.copy_full_into_param(layer.bias, b, g)
        xp = x.clone().requires_grad_()
        y = layer(xp)
        go = grad_out if gather else mpu.shard(grad_out, -1, state.tp_rank, state.tp_size)
        _close(
            f"column gather={gather} output",
            y,
            ref(x) if gather else mpu.shard(ref(x), -1, state.tp_rank, state.tp_size),
        )
        y.backward(go)
        _close(f"column gather={gather} dX", xp.grad, xr.grad)
        _close(
            "column dW",
            layer.weight.grad,
            mpu.shard(ref.weight.grad, 0, state.tp_rank, state.tp_size),
        )
        _close(
            "column db", layer.bias.grad, mpu.shard(ref.bias.grad, 0, state.tp_rank, state.tp_size)
        )


def _check_row(state):
    g, r, p = state.tp_group, state.tp_rank, state.tp_size
    x, w, b = _randn(3, 5, 8, seed=5), _randn(6, 8, seed=6), _randn(6, seed=7)
    grad_out = _randn(3, 5, 6, seed=8)
    ref, xr = _reference_linear(x, w, b, grad_out)
    for parallel_input in (False, True):
        layer = mpu.RowParallelLinear(
            8, 6, group=g, input_is_parallel=parallel_input, init_method=None, dtype=DT
        )
        mpu.copy_full_into_param(layer.weight, w, g)
        mpu.copy_full_into_param(layer.bias, b, g)
        xin = mpu.shard(x, -1, r, p) if parallel_input else x
        xp = xin.clone().requires_grad_()
        y = layer(xp)
        _close(f"row parallel_input={parallel_input} output", y, ref(x))
        y.backward(grad_out)
        expected_dx = mpu.shard(xr.grad, -1, r, p) if parallel_input else xr.grad
        _close(f"row parallel_input={parallel_input} dX", xp.grad, expected_dx)
        _close("row dW", layer.weight.grad, mpu.shard(ref.weight.grad, 1, r, p))
        _close("row db", layer.bias.grad, ref.bias.grad)


def _check_embedding_and_cross_entropy(state):
    g, r, p = state.tp_group, state.tp_rank, state.tp_size
    vocab, h = 16, 6
    w = _randn(vocab, h, seed=9)
    ids = torch.randint(0, vocab, (4, 7), generator=torch.Generator().manual_seed(10))
    grad_out = _randn(4, 7, h, seed=11)
    ref = nn.Embedding(vocab, h, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(w)
    ref(ids).backward(grad_out)
    emb = mpu.VocabParallelEmbedding(vocab, h, group=g, init_method=None, dtype=DT)
    mpu.copy_full_into_param(emb.weight, w, g)
    out = emb(ids)
    _close("embedding output", out, F.embedding(ids, w))
    out.backward(grad_out)
    _close("embedding dW", emb.weight.grad, mpu.shard(ref.weight.grad, 0, r, p))

    # Large logits make a naive exp overflow; the max subtraction must handle them.
    logits = _randn(4, 7, vocab, seed=12) * 30 + 500
    target = torch.randint(0, vocab, (4, 7), generator=torch.Generator().manual_seed(13))
    weights = _randn(4, 7, seed=14)
    full = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(full.view(-1, vocab), target.view(-1), reduction="none")
    (ref_loss.view(4, 7) * weights).sum().backward()
    local = mpu.shard(logits, -1, r, p).requires_grad_()
    loss = mpu.vocab_parallel_cross_entropy(local, target, g)
    _close("cross-entropy loss", loss, ref_loss.view(4, 7))
    (loss * weights).sum().backward()
    _close("cross-entropy dlogits", local.grad, mpu.shard(full.grad, -1, r, p))


def _check_mappings(state):
    g, r, p = state.tp_group, state.tp_rank, state.tp_size
    x = _randn(2, 4 * p, seed=15).requires_grad_()
    y = mpu.gather_from_tensor_model_parallel_region(
        mpu.scatter_to_tensor_model_parallel_region(x, g), g
    )
    _close("scatter->gather is identity", y, x)
    y.backward(torch.ones_like(y))
    _close("scatter->gather backward", x.grad, torch.ones_like(x))
    # copy_to's backward sums every rank's gradient.
    z = torch.ones(3, dtype=DT, requires_grad=True)
    mpu.copy_to_tensor_model_parallel_region(z, g).backward(
        torch.full((3,), float(r + 1), dtype=DT)
    )
    _close("copy_to backward all-reduces", z.grad, torch.full((3,), p * (p + 1) / 2, dtype=DT))


def _check_all_to_all_hand_over(state):
    """The token all-to-all calls the hand-over it is given (megatron.mpu.overlap's, for
    DualPipeV) once going and once coming back, and nothing when given none; the tokens it
    moves are the same either way."""
    g, r, p = state.tp_group, state.tp_rank, state.tp_size
    splits, calls = [2] * p, []
    rows = [(torch.arange(2 * p, dtype=DT) + 100 * r).view(-1, 1).requires_grad_() for _ in "ab"]
    hooked = all_to_all(rows[0], g, splits, splits, lambda: calls.append("hand-over"))
    assert calls == ["hand-over"], calls
    hooked.backward(torch.ones_like(hooked))
    assert calls == ["hand-over"] * 2, calls
    plain = all_to_all(rows[1], g, splits, splits)
    plain.backward(torch.ones_like(plain))
    assert calls == ["hand-over"] * 2, calls  # not given one: none called
    expected = torch.tensor([[2 * r + k + 100 * j] for j in range(p) for k in (0, 1)], dtype=DT)
    for y, x in zip((hooked, plain), rows, strict=True):
        _close("all-to-all rows", y, expected)
        _close("all-to-all backward", x.grad, torch.ones_like(x))


def _check_grad_norm(state):
    g, r = state.tp_group, state.tp_rank
    torch.manual_seed(0)  # same replicated data on every rank
    full = nn.Sequential(
        nn.Linear(8, 12, dtype=DT), nn.LayerNorm(12, dtype=DT), nn.Linear(12, 8, dtype=DT)
    )
    col = mpu.ColumnParallelLinear(8, 12, group=g, init_method=None, dtype=DT)
    norm = nn.LayerNorm(12, dtype=DT)  # replicated over TP: counted once
    row = mpu.RowParallelLinear(12, 8, group=g, init_method=None, dtype=DT)
    for p_, ref in (
        (col.weight, full[0].weight),
        (col.bias, full[0].bias),
        (row.weight, full[2].weight),
        (row.bias, full[2].bias),
    ):
        mpu.copy_full_into_param(p_, ref.detach(), g)
    x = _randn(5, 8, seed=16)
    # LayerNorm sits after the column-parallel layer here only to create a replicated param;
    # feed it the gathered activations so both models compute the same function.
    h = mpu.gather_from_tensor_model_parallel_region(col(x), g)
    row(norm(h)).pow(2).sum().backward()  # row scatters its (replicated) input itself
    full(x).pow(2).sum().backward()
    params = [col.weight, col.bias, norm.weight, norm.bias, row.weight, row.bias]
    ref_params = list(full.parameters())
    ref_norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in ref_params]))
    got = mpu.grad_norm(params, tp_rank=r, model_parallel_group=g)
    _close("grad norm", got, ref_norm)
    inf_ref = max(q.grad.abs().max() for q in ref_params)
    _close(
        "inf grad norm",
        mpu.grad_norm(params, tp_rank=r, model_parallel_group=g, norm_type=float("inf")),
        inf_ref,
    )
    max_norm = float(ref_norm) / 4
    mpu.clip_grad_norm(params, max_norm, tp_rank=r, model_parallel_group=g)
    torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    _close("clipped dW", row.weight.grad, mpu.shard(full[2].weight.grad, 1, r, state.tp_size))
    _close("clipped norm weight", norm.weight.grad, full[1].weight.grad)


def _check_rng(state):
    g = state.tp_group
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(mpu.MODEL_PARALLEL_RNG, 1000 + state.tp_rank)
    torch.manual_seed(42)
    with tracker.fork():
        split = torch.rand(4, dtype=DT)
    shared = torch.rand(4, dtype=DT)
    gathered = [torch.empty_like(split) for _ in range(state.tp_size)]
    dist.all_gather(gathered, split, group=g)
    if any(torch.equal(gathered[0], t) for t in gathered[1:]):
        raise AssertionError("model-parallel RNG stream must differ between TP ranks")
    torch.manual_seed(42)
    _close("fork leaves the default stream untouched", torch.rand(4, dtype=DT), shared)


def _check_groups(rank, world):
    for tp, pp, cp in ((2, 2, 1), (1, 2, 1), (4, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)):
        state = initialize_model_parallel(tp, pp, context_parallel_size=cp)
        grid = mpu.parallel_state.rank_grid(world, tp, pp, cp)  # [PP, DP, CP, TP]
        p, d, c, t = state.pp_rank, state.dp_rank, state.cp_rank, state.tp_rank
        where = f"tp={tp} pp={pp} cp={cp}"
        if grid[p, d, c, t] != rank:
            raise AssertionError(f"{where}: rank {rank} is not at its grid position")
        for name, ranks, expected in (
            ("TP", state.tp_ranks, grid[p, d, c, :]),
            ("PP", state.pp_ranks, grid[:, d, c, t]),
            ("CP", state.cp_ranks, grid[p, d, :, t]),
        ):
            if ranks != tuple(expected.tolist()):
                raise AssertionError(f"{where}: wrong {name} group {ranks}")
        # A sum over each group equals the sum of its ranks: the groups really connect them.
        for name, group, ranks in (
            ("tp", state.tp_group, state.tp_ranks),
            ("dp", state.dp_group, state.dp_ranks),
            ("pp", state.pp_group, state.pp_ranks),
            ("cp", state.cp_group, state.cp_ranks),
            ("dp x cp", state.dp_cp_group, tuple(grid[p, :, :, t].flatten().tolist())),
        ):
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=group)
            if x.item() != sum(ranks):
                raise AssertionError(f"{name} group of rank {rank} sums to {x.item()}")
        if state.dp_cp_size != state.dp_size * cp or state.dp_cp_rank != d * cp + c:
            raise AssertionError(f"{where}: DP x CP index {state.dp_cp_rank}")
        if state.in_embedding_group != (state.is_first_stage or state.is_last_stage):
            raise AssertionError("embedding group must hold the first and last stage")
        destroy_model_parallel(state)


def _worker(rank, world):
    _check_groups(rank, world)
    for tp in (4, 2):
        state = initialize_model_parallel(tp, 1)
        for check in (
            _check_column,
            _check_row,
            _check_embedding_and_cross_entropy,
            _check_mappings,
            _check_all_to_all_hand_over,
            _check_grad_norm,
            _check_rng,
        ):
            check(state)
        destroy_model_parallel(state)
    return True


@pytest.mark.slow
def test_mpu_matches_single_process_at_tp4_and_tp2():
    assert run_distributed(_worker, 4) == [True] * 4
