"""BertModel: equal to transformers' BertForPreTraining at TP = 1 (post-LN), the same model at
TP = 1 and 2, padding that changes nothing, and the HF conversion both ways."""

import dataclasses

import pytest
import torch

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.models.bert.evaluate import vocab_parallel_argmax
from megatron.models.bert.hf import bert_to_hf, hf_bert_config, hf_to_bert
from megatron.models.bert.model import BertModel
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed

# vocab 100 pads to 104 / 112 at TP 1 / 2: the padding differs, the model must not.
CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=12,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    layernorm_epsilon=1e-12,
    apply_residual_connection_post_layernorm=True,
)
DT = torch.float64


def _batch(cfg=CFG, b=3):
    """tokens, tokentypes, padding mask (the last samples padded), labels."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g)
    types = (torch.arange(cfg.seq_length) >= cfg.seq_length // 2).long().expand(b, -1)
    pad = torch.ones(b, cfg.seq_length, dtype=torch.long)
    pad[1, -3:], pad[2, -5:] = 0, 0
    labels = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g)
    return tokens, types.contiguous(), pad, labels


def _hf_model(model):
    from transformers import BertForPreTraining

    hf = BertForPreTraining(hf_bert_config(CFG)).to(DT).eval()
    missing, unexpected = hf.load_state_dict(bert_to_hf(model.state_dict(), CFG), strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k], missing
    return hf


@pytest.mark.slow  # over a second on 2 cores
def test_tp1_bert_equals_transformers_bert_for_pretraining():
    model = BertModel(CFG, BuildContext(seed=3, dtype=DT)).eval()
    tokens, types, pad, _ = _batch()
    logits, nsp = model(tokens, pad, types)
    assert torch.isinf(logits[..., CFG.vocab_size :]).all(), "padding logits must be masked"
    out = _hf_model(model)(input_ids=tokens, token_type_ids=types, attention_mask=pad)
    real = pad.bool()  # HF's outputs at padding positions are also defined, but compare real ones
    torch.testing.assert_close(
        logits[..., : CFG.vocab_size][real], out.prediction_logits[real], rtol=1e-9, atol=1e-9
    )
    torch.testing.assert_close(nsp, out.seq_relationship_logits, rtol=1e-9, atol=1e-9)


@pytest.mark.slow  # over a second on 2 cores
def test_hf_import_gives_back_the_same_weights_and_pre_ln_is_refused():
    model = BertModel(CFG, BuildContext(seed=5, dtype=DT))
    sd = model.state_dict()
    back = hf_to_bert(_hf_model(model).state_dict(), CFG, CFG.padded_vocab_size(1))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    pre_ln = dataclasses.replace(CFG, apply_residual_connection_post_layernorm=False)
    with pytest.raises(ValueError, match="apply-residual-connection-post-layernorm"):
        bert_to_hf(sd, pre_ln)


@pytest.mark.slow  # over a second on 2 cores
def test_padding_changes_nothing_for_the_real_tokens_and_no_binary_head():
    cfg = dataclasses.replace(CFG, apply_residual_connection_post_layernorm=False)
    model = BertModel(cfg, BuildContext(seed=3, dtype=DT)).eval()
    tokens, types, pad, _ = _batch(cfg)
    logits, _ = model(tokens, pad, types)
    short, _ = model(tokens[2:, :-5], pad[2:, :-5], types[2:, :-5])
    torch.testing.assert_close(logits[2:, :-5], short, rtol=1e-10, atol=1e-10)
    headless = BertModel(cfg, BuildContext(seed=3, dtype=DT), binary_head=False)
    assert headless(tokens, pad, types)[1] is None
    assert not any("pooler" in k or "binary" in k for k in headless.state_dict())


@pytest.mark.slow  # over a second on 2 cores
def test_unfused_masked_softmax_path_equals_sdpa_with_padding():
    from megatron.fused_kernels import FusedOps

    tokens, types, pad, labels = _batch()
    results = []
    for ops in (None, FusedOps(attention_backend="unfused")):
        model = BertModel(CFG, BuildContext(seed=3, dtype=DT, ops=ops))
        loss, nsp = model(tokens, pad, types, labels)
        ((loss * pad).sum() + nsp.sum()).backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k], rtol=1e-8, atol=1e-12, msg=k)


def _grads_full(model, state):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if mpu.is_tensor_parallel(p) and state.tp_size > 1:
            parts = [torch.empty_like(g) for _ in range(state.tp_size)]
            torch.distributed.all_gather(parts, g.contiguous(), group=state.tp_group)
            g = mpu.unshard(parts, p.partition_dim, p.partition_stride)
        out[name] = g
    return out


def _run(model, batch, ops=None):
    tokens, types, pad, labels = batch
    loss, nsp = model(tokens, pad, types, labels)
    total = (loss * pad).sum() / pad.sum() + torch.nn.functional.cross_entropy(
        nsp, torch.tensor([0, 1, 1])
    )
    total.backward()
    return total.detach()


def _tp_worker(rank, world):
    torch.manual_seed(0)
    batch = _batch()
    for post_ln in (True, False):
        cfg = dataclasses.replace(CFG, apply_residual_connection_post_layernorm=post_ln)
        ref = BertModel(cfg, BuildContext(seed=3, dtype=DT))
        ref_loss, ref_grads = _run(ref, batch), _grads_full(ref, mpu.single_process_state())
        state = initialize_model_parallel(2, 1)
        model = BertModel(cfg, BuildContext(state, seed=3, dtype=DT))
        loss, grads = _run(model, batch), _grads_full(model, state)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
        for name, g in grads.items():
            rows = (
                cfg.vocab_size
                if name in ("embedding.word_embeddings.weight", "head.lm_bias")
                else None
            )
            torch.testing.assert_close(
                g[:rows],
                ref_grads[name][:rows],
                rtol=1e-8,
                atol=1e-12,
                msg=lambda m, n=name: f"{n}: {m}",
            )
        with torch.no_grad():
            tokens, types, pad, _ = batch
            want = ref(tokens, pad, types)[0].argmax(-1)
            got = vocab_parallel_argmax(model(tokens, pad, types)[0], state.tp_group)
        assert torch.equal(got, want), "the argmax of vocab-parallel logits"
        destroy_model_parallel(state)
    return True


@pytest.mark.slow
def test_same_loss_and_gradients_at_tp1_and_tp2():
    assert run_distributed(_tp_worker, 2) == [True, True]
