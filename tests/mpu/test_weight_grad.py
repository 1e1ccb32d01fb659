"""The zero-bubble weight-gradient split (megatron.mpu.weight_grad) is an object given to one
model's layers, not a mode of the process: a model not given it computes plain gradients while
another one runs split in the same process, and the layers hold it only while given."""

import torch

from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from megatron.mpu.weight_grad import SLOT, WeightGradSplit, run_weight_grads
from tests.helpers.models import tiny_gpt

_CFG = tiny_gpt(num_experts=4)  # the experts' grouped matmuls take the split too


def _model() -> GPTModel:
    return GPTModel(_CFG, BuildContext(seed=3, dtype=torch.float64))


def _grads(model: GPTModel) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def _holders(model: GPTModel) -> list:
    return [getattr(m, SLOT) for m in model.modules() if hasattr(m, SLOT)]


def test_a_model_not_given_the_split_computes_plain_gradients_beside_one_that_is():
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    reference, plain, split_model = _model(), _model(), _model()
    reference(tokens, labels=tokens).mean().backward()

    weight_grads, queue = WeightGradSplit(), []
    with weight_grads.given_to(split_model):
        assert set(map(id, _holders(split_model))) == {id(weight_grads)}
        assert set(_holders(plain)) == {None}  # the linears, experts, embedding, head: none
        split_loss = split_model(tokens, labels=tokens).mean()
        plain_loss = plain(tokens, labels=tokens).mean()
        with weight_grads.deferring(queue):  # the split's queue open, as in a pipeline's B
            plain_loss.backward()
            assert queue == []  # the plain model queued nothing: its gradients are all here
            split_loss.backward()
        dense = split_model.layers["0"].self_attention.dense.weight
        assert len(queue) >= 8 and dense.grad is None  # B left the big weights for W
        run_weight_grads(queue)
    assert set(_holders(split_model)) == {None}  # taken back when the step ends

    for name, g in _grads(reference).items():
        assert torch.equal(_grads(plain)[name], g), name  # bit for bit the plain backward
        torch.testing.assert_close(_grads(split_model)[name], g, msg=name)
