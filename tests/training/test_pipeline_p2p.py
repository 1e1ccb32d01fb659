"""The pipeline's point-to-point traffic as NCCL needs it: between two stages each direction
has its own group (NCCL runs a group's sends and receives with one peer on one stream, and a
send holds that stream until the peer receives, so two stages sending to each other on one
group would wait for ever), and every receive is posted in the order its sender sends.

Recorded on gloo ranks from the real executor (megatron.training.pipeline) for every schedule,
training and evaluation steps."""

import torch
from torch import nn

from megatron.mpu.parallel_state import initialize_model_parallel
from megatron.schedules.registry import V_SHAPED
from megatron.training.pipeline import forward_backward_pipelining
from tests.helpers.distributed import run_distributed

P, M = 4, 8
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))


class _Chunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self._input = nn.Parameter(torch.full((1,), 1.5)), None

    def set_input_tensor(self, x):
        self._input = x

    def forward(self):
        x = self._input if self._input is not None else torch.ones(1, 2, 4)
        return x * self.w


def _forward_step(data_iterator, chunk):
    next(data_iterator)
    return chunk(), lambda out: (out.sum(), {"lm loss": out.sum().detach()})


def _recorded_worker(rank, world):
    """Per schedule and step kind: this rank's ops (op, group name, peer stage, tag) in the
    order the executor issued them."""
    dist = torch.distributed
    results, log = {}, []
    isend, irecv = dist.isend, dist.irecv

    def recorder(op, real):
        def call(tensor, peer, group=None, tag=0):
            name = {id(state.pp_up_group): "up", id(state.pp_down_group): "down"}
            log.append((op, name.get(id(group), "default"), state.pp_ranks.index(peer), tag))
            return real(tensor, peer, group=group, tag=tag)

        return call

    dist.isend, dist.irecv = recorder("send", isend), recorder("recv", irecv)
    try:
        for schedule, V in SCHEDULES:
            state = initialize_model_parallel(
                1, world, V if V > 1 else None, pipeline_v=schedule in V_SHAPED
            )
            model = nn.ModuleList(_Chunk() for _ in range(V))
            for forward_only in (False, True):
                log.clear()
                forward_backward_pipelining(
                    _forward_step, iter(range(10**6)), model, M, state=state,
                    shape=(1, 2, 4), dtype=torch.float32, schedule=schedule,
                    forward_only=forward_only,
                )  # fmt: skip
                results[(schedule, forward_only)] = (state.pp_rank, list(log))
    finally:
        dist.isend, dist.irecv = isend, irecv
    return results


def _streams_finish(logs: dict, one_group: bool) -> bool:
    """NCCL's stream model on the recorded ops: per stage pair and group, each side's ops run in
    issue order, and a send and the peer's receive of it complete together (a send blocks its
    stream until then). `one_group`: as if both directions shared one group."""
    streams = {}
    for stage, ops in logs.items():
        for op, group, peer, tag in ops:
            key = (min(stage, peer), max(stage, peer), "all" if one_group else group, stage)
            streams.setdefault(key, []).append((op, tag))
    for (a, b, group, side), mine in streams.items():
        if side != a:
            continue
        theirs = streams.get((a, b, group, b), [])
        if len(mine) != len(theirs):
            return False
        for (op, tag), (peer_op, peer_tag) in zip(mine, theirs, strict=True):
            if tag != peer_tag or {op, peer_op} != {"send", "recv"}:
                return False  # both heads wait on a peer that cannot reach them
    return True


def test_each_direction_has_its_own_group_and_receives_follow_the_sends():
    per_rank = run_distributed(_recorded_worker, P)
    logs_1f1b = dict(ranks[("1f1b", False)] for ranks in per_rank)
    assert not _streams_finish(logs_1f1b, one_group=True)  # why the directions are split
    for key in per_rank[0]:
        logs = dict(ranks[key] for ranks in per_rank)  # stage -> its ops
        sends, recvs = {}, {}
        for stage, ops in logs.items():
            for op, group, peer, tag in ops:
                src, dst = (stage, peer) if op == "send" else (peer, stage)
                assert group == ("up" if dst > src else "down"), (key, stage, op, group, peer)
                (sends if op == "send" else recvs).setdefault((src, dst), []).append(tag)
        assert sends, key  # every schedule here crosses stages
        assert sends == recvs, key  # each receive posted in its sender's order
        assert _streams_finish(logs, one_group=False), key
