"""The flags of this wave's features reach their settings as their peers spell them: Muon's
(Megatron-core's and the older MindSpeed spelling of Nesterov), the DeepSeek-V3 router's top-k
scaling factor, torchft's minimum replica count."""

from megatron.config.cli import parse_args
from tests.helpers.training import BASE


def test_muon_flags_and_their_spellings_reach_the_optimizer_settings():
    muon = [*BASE, "--optimizer", "muon"]
    default = parse_args(muon, world_size=1).optimizer
    assert (default.muon_nesterov, default.muon_scale_mode) == (True, "spectral")
    assert default.muon_extra_scale_factor == 0.2
    for spelling in ("--muon-nesterov", "--muon-use-nesterov"):
        assert parse_args([*muon, spelling], world_size=1).optimizer.muon_nesterov
    assert not parse_args([*muon, "--no-muon-nesterov"], world_size=1).optimizer.muon_nesterov
    given = ["--muon-scale-mode", "unit_rms_norm", "--muon-extra-scale-factor", "1.0"]
    opt = parse_args([*muon, *given, "--muon-ns-steps", "3"], world_size=1).optimizer
    assert (opt.muon_scale_mode, opt.muon_extra_scale_factor) == ("unit_rms_norm", 1.0)
    assert opt.muon_num_ns_steps == 3


def test_router_scaling_factor_and_ft_min_replicas_reach_their_settings():
    moe = [*BASE, "--num-experts", "4", "--moe-router-topk", "2"]
    moe += ["--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5"]
    assert parse_args(moe, world_size=1).model.moe_router_topk_scaling_factor == 2.5
    ft = [*BASE, "--fault-tolerance", "--ft-group-size", "4", "--ft-min-replica-size", "3"]
    assert parse_args(ft, world_size=1).parallel.ft_min_replica_size == 3
