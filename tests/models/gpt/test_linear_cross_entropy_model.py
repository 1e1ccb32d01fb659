"""--cross-entropy-fusion-impl linear in the GPT: the model's per-token loss and every gradient
(tied and untied output layer) equal the native path's without the logits ever being built, the
trainer logs the same losses (one process, TP 2 + sequence parallel, PP 2), and the combinations it
cannot honour are refused by flag."""

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.config.schema import ModelConfig
from megatron.config.schema_kernels import KernelConfig
from megatron.fused_kernels import select_ops
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel, OutputHead
from tests.helpers.distributed import run_distributed
from tests.helpers.planning import saved_and_predicted_activations
from tests.helpers.training import BASE, _losses, _train, assert_same_run, flags

LINEAR = KernelConfig(cross_entropy_fusion_impl="linear")


def _cfg(untied: bool) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=12,
        vocab_size=60,  # padded to 64: the last 4 rows are padding
        make_vocab_size_divisible_by=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        untie_embeddings_and_output_weights=untied,
    )


def _loss_and_grads(cfg, ops, tokens, labels, mask):
    model = GPTModel(cfg, BuildContext(seed=5, dtype=torch.float64, ops=ops))
    loss = model(tokens, labels=labels)
    ((loss * mask).sum() / mask.sum()).backward()  # as lm_loss weighs it
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("untied", [False, True])
def test_model_loss_and_gradients_equal_the_native_path(untied, monkeypatch):
    cfg = _cfg(untied)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 60, (2, 12), generator=g)
    labels = torch.randint(0, 60, (2, 12), generator=g)
    mask = (torch.rand(2, 12, generator=g) > 0.3).double()
    ref_loss, ref_grads = _loss_and_grads(cfg, None, tokens, labels, mask)

    def no_logits(*args, **kwargs):
        raise AssertionError("the linear path built the logits")

    monkeypatch.setattr(OutputHead, "logits", no_logits)
    loss, grads = _loss_and_grads(cfg, select_ops(LINEAR, "cpu"), tokens, labels, mask)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for k, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[k], rtol=1e-10, atol=1e-13, msg=k)
    weight = "head.output_layer.weight" if untied else "embedding.word_embeddings.weight"
    assert grads[weight].abs().sum() > 0
    if untied:
        assert not grads[weight][60:].any(), "padding rows got gradient"


def test_the_flag_reaches_the_ops_and_is_logged():
    cfg = parse_args([*BASE, "--cross-entropy-fusion-impl", "linear"], world_size=1)
    assert cfg.kernels.cross_entropy_fusion_impl == "linear"
    assert parse_args(BASE, world_size=1).kernels.cross_entropy_fusion_impl == "native"
    ops = select_ops(cfg.kernels, "cpu")
    assert "cross-entropy = torch (fused with the output layer" in ops.describe()
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--cross-entropy-fusion-impl", "te"], world_size=1)


@pytest.mark.parametrize(
    "extra,world,purpose,match",
    [
        (["--fp16-lm-cross-entropy", "--bf16"], 1, "config", "--fp16-lm-cross-entropy"),
        (["--deepspeed", "--pipeline-model-parallel-size", "2"], 2, "config", "pipeline"),
        ([], 1, "eval-bert", "BERT"),
    ],
)
def test_combinations_it_cannot_honour_are_refused(extra, world, purpose, match):
    argv = [*BASE, "--cross-entropy-fusion-impl", "linear", *extra]
    with pytest.raises(ConfigError, match=match) as err:
        validate(parse_args(argv, world_size=world), purpose)
    assert "--cross-entropy-fusion-impl" in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.slow
def test_training_logs_the_native_paths_losses(data_prefix):
    argv = flags(data_prefix, "--adam-eps", "1e-4", iters=3)
    ((ref, _, _),) = run_distributed(_train, 1, argv)
    linear = [*argv, "--cross-entropy-fusion-impl", "linear"]
    ((one, _, _),) = run_distributed(_train, 1, linear)
    assert_same_run(one, ref, "linear, one process")
    for name, extra in (
        ("TP 2 + sequence parallel", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("PP 2 (tied embedding on the last stage)", ["--pipeline-model-parallel-size", "2"]),
    ):
        for rank, (history, _, _) in enumerate(run_distributed(_train, 2, [*linear, *extra])):
            assert_same_run(history, ref, f"linear, {name}, rank {rank}")
    assert len(_losses(ref)) == 3


def test_the_memory_model_counts_a_log_sum_exp_instead_of_the_logits():
    m = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256
    )
    native, _ = saved_and_predicted_activations(m)
    measured, predicted = saved_and_predicted_activations(m, "linear")
    assert abs(predicted - measured) / measured < 0.01
    logits = 4 * 2 * 32 * 256  # fp32, micro batch 2 x 32 tokens
    assert native - measured >= logits, "the linear path must not keep the logits"
