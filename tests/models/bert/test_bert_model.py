"""BertModel: equal to its transformers twin at TP = 1 (post-LN: BertForPreTraining; pre-LN:
MegatronBertForPreTraining; *ForMaskedLM without the binary head), the same model at TP = 1
and 2, padding that changes nothing, and the HF weight mapping both ways."""

import dataclasses
import json
import os

import pytest
import torch

from megatron import mpu
from megatron.checkpoint.resharding import load_checkpoint, model_config, save_resharded
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.models.bert.evaluate import vocab_parallel_argmax
from megatron.models.bert.hf import (
    bert_to_hf,
    hf_architecture,
    hf_bert_config,
    hf_to_bert,
    import_hf_bert,
)
from megatron.models.bert.model import BertModel
from megatron.models.bert.spec import SPEC
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.checkpoints import _cli as _convert_cli
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


def _cfg(post_ln: bool) -> ModelConfig:
    return dataclasses.replace(CFG, apply_residual_connection_post_layernorm=post_ln)


def _model(cfg, seed, binary_head=True):
    """A float64 BertModel whose norms and biases are not their init (1 and 0), so that a norm
    or bias mapped to the wrong place changes the logits; the padding vocab rows stay zero."""
    model = BertModel(cfg, BuildContext(seed=seed, dtype=DT), binary_head=binary_head).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                rows = cfg.vocab_size if name == "head.lm_bias" else None
                p[:rows] += 0.1 * torch.randn(p[:rows].shape, generator=g, dtype=DT)
    return model


def _hf_model(model, cfg, binary_head=True):
    import transformers

    arch = hf_architecture(cfg, binary_head)
    assert arch.startswith("Bert" if cfg.apply_residual_connection_post_layernorm else "Megatron")
    hf = getattr(transformers, arch)(hf_bert_config(cfg)).to(DT).eval()
    missing, unexpected = hf.load_state_dict(bert_to_hf(model.state_dict(), cfg), strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k], missing
    return hf


TWINS = [  # (post-LN?, binary head?)
    pytest.param(True, True, id="post-LN-BertForPreTraining"),
    pytest.param(False, True, id="pre-LN-MegatronBertForPreTraining"),
    pytest.param(False, False, id="pre-LN-no-binary-head-MegatronBertForMaskedLM"),
    pytest.param(True, False, id="post-LN-no-binary-head-BertForMaskedLM"),
]


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("post_ln, binary_head", TWINS)
def test_tp1_bert_equals_its_transformers_twin(post_ln, binary_head):
    cfg = _cfg(post_ln)
    model = _model(cfg, 3, binary_head)
    tokens, types, pad, _ = _batch()
    with torch.no_grad():
        logits, nsp = model(tokens, pad, types)
        out = _hf_model(model, cfg, binary_head)(
            input_ids=tokens, token_type_ids=types, attention_mask=pad
        )
    assert torch.isinf(logits[..., CFG.vocab_size :]).all(), "padding logits must be masked"
    real = pad.bool()  # HF's outputs at padding positions are also defined, but compare real ones
    hf_logits = out.prediction_logits if binary_head else out.logits
    torch.testing.assert_close(
        logits[..., : CFG.vocab_size][real], hf_logits[real], rtol=1e-9, atol=1e-9
    )
    if binary_head:
        torch.testing.assert_close(nsp, out.seq_relationship_logits, rtol=1e-9, atol=1e-9)
    else:
        assert nsp is None and not hasattr(out, "seq_relationship_logits")


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("post_ln, binary_head", TWINS)
def test_hf_import_gives_back_the_same_weights(post_ln, binary_head):
    cfg = _cfg(post_ln)
    model = _model(cfg, 5, binary_head)
    sd = model.state_dict()
    back = hf_to_bert(
        _hf_model(model, cfg, binary_head).state_dict(), cfg, CFG.padded_vocab_size(1)
    )
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"num_query_groups": 2}, "--num-query-groups"),
        ({"kv_channels": 4}, "--kv-channels"),
        ({"swiglu": True}, "--swiglu"),
        ({"normalization": "RMSNorm"}, "--normalization LayerNorm"),
        ({"position_embedding_type": "rope"}, "--position-embedding-type learned"),
        ({"add_bias_linear": False}, "--disable-bias-linear"),
        ({"num_unique_layers": 1}, "--num-unique-layers"),
    ],
)
def test_what_no_twin_expresses_is_refused_by_flag(change, flag):
    for post_ln, twin in ((True, "BertForPreTraining"), (False, "MegatronBertForPreTraining")):
        with pytest.raises(ValueError, match=f"{twin} would need .*{flag}"):
            hf_architecture(dataclasses.replace(_cfg(post_ln), **change))


_ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_size",
    "max_positions",
    "vocab_size",
    "layernorm_epsilon",
    "openai_gelu",
    "apply_residual_connection_post_layernorm",
)


_MEGATRON_BERT_CONFIG = {  # config.json of _cfg(False)'s twin, as transformers writes it
    "model_type": "megatron-bert",
    "architectures": ["MegatronBertForPreTraining"],
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 12,
    "vocab_size": 100,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
}


def _write_bert_checkpoint(root, model, cfg, family, tmp_path):
    """The trainer's checkpoint of `model` (real vocab rows, TP 2 x PP 2), with a vocab.txt."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"[unused{i}]\n" for i in range(cfg.vocab_size)))
    state = {
        n: t.detach()[: cfg.vocab_size] if n in SPEC.vocab_sized else t.detach()
        for n, t in model.state_dict().items()
    }
    args = {
        "model": dataclasses.asdict(cfg),
        "tokenizer": {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": str(vocab)},
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "padded_vocab_size": cfg.padded_vocab_size(2),
        "params_dtype": "torch.float32",
        "model_family": family,
    }
    save_resharded(state, args, str(root), 2, 2, 7, quiet=True)
    return state


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("post_ln, binary_head", TWINS)
def test_convert_checkpoint_to_hf_and_back(post_ln, binary_head, tmp_path):
    """--to-hf, AutoModelForPreTraining (and ForMaskedLM) of the directory give our logits;
    --from-hf of it, and of what transformers saves from it, gives back the same weights."""
    import transformers

    cfg = _cfg(post_ln)
    model = _model(cfg, 9, binary_head).float()
    family = "bert" if binary_head else "bert-no-binary-head"
    state = _write_bert_checkpoint(tmp_path / "ck", model, cfg, family, tmp_path)
    convert, hf_dir = _convert_cli(), str(tmp_path / "hf")
    assert convert(["--load", str(tmp_path / "ck"), "--to-hf", hf_dir]) == 0
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = hf_architecture(cfg, binary_head)
    assert config["architectures"] == [arch] and config["vocab_size"] == cfg.vocab_size
    assert config["model_type"] == ("bert" if post_ln else "megatron-bert")
    assert os.path.isfile(os.path.join(hf_dir, "vocab.txt"))
    tokens, types, pad, _ = _batch()
    with torch.no_grad():
        logits, nsp = model(tokens, pad, types)
        loaded = {
            auto: getattr(transformers, auto).from_pretrained(hf_dir).eval()
            for auto in ("AutoModelForPreTraining", "AutoModelForMaskedLM")
        }
        outs = {
            a: m(input_ids=tokens, token_type_ids=types, attention_mask=pad)
            for a, m in loaded.items()
        }
    assert type(loaded["AutoModelForPreTraining"]).__name__ == arch.replace(
        "MaskedLM", "PreTraining"
    )
    real, ours = pad.bool(), logits[..., : cfg.vocab_size]
    for out in (
        outs["AutoModelForPreTraining"].prediction_logits,
        outs["AutoModelForMaskedLM"].logits,
    ):
        torch.testing.assert_close(ours[real], out[real], rtol=1e-5, atol=1e-5)
    if binary_head:  # without it, AutoModelForPreTraining's NSP head is new (random) weights
        nsp_hf = outs["AutoModelForPreTraining"].seq_relationship_logits
        torch.testing.assert_close(nsp, nsp_hf, rtol=1e-5, atol=1e-5)
    saved = str(tmp_path / "saved_by_transformers")
    loaded["AutoModelForPreTraining" if binary_head else "AutoModelForMaskedLM"].save_pretrained(
        saved
    )
    for i, src in enumerate((hf_dir, saved)):
        _assert_imports_back(src, str(tmp_path / f"back{i}"), state, cfg, family)


def _assert_imports_back(hf_dir, save, state, cfg, family):
    """--from-hf hf_dir --save save (at TP 2) holds `state` and the architecture of `cfg`."""
    argv = ["--from-hf", hf_dir, "--save", save, "--target-tensor-model-parallel-size", "2"]
    assert _convert_cli()(argv) == 0
    loaded = load_checkpoint(save)
    assert loaded.args["model_family"] == family
    got = model_config(loaded.args)
    for field in _ARCH_FIELDS:
        assert getattr(got, field) == getattr(cfg, field), (hf_dir, field)
    assert set(loaded.state) == set(state)
    for name, t in state.items():
        assert torch.equal(loaded.state[name], t), (hf_dir, name)


def test_from_hf_takes_either_bias_name_and_refuses_what_our_bert_cannot_run(tmp_path, capsys):
    pytest.importorskip("safetensors", reason="HF files are safetensors")
    from safetensors.torch import save_file

    cfg = _cfg(False)
    model = _model(cfg, 2).float()
    tensors = bert_to_hf(model.state_dict(), cfg)
    tensors.pop("cls.predictions.decoder.weight")  # tied to the word embedding
    tensors.pop("cls.predictions.bias")  # tied: some files hold it as the decoder's bias
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()

    def write(tensors, **config):
        save_file(tensors, str(hf_dir / "model.safetensors"))
        (hf_dir / "config.json").write_text(json.dumps({**_MEGATRON_BERT_CONFIG, **config}))

    write(tensors)
    state, args = import_hf_bert(str(hf_dir), _MEGATRON_BERT_CONFIG)
    assert args["model_family"] == "bert" and set(state) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(state[name], t[: state[name].shape[0]]), name
    convert = _convert_cli()
    for broken, config, message in (
        (tensors, {"hidden_act": "relu"}, "config.json hidden_act = 'relu' has no counterpart"),
        (tensors, {"type_vocab_size": 3}, "config.json type_vocab_size = 3"),
        (
            {n: t for n, t in tensors.items() if n != "cls.seq_relationship.weight"},
            {},
            "this file has only bert.pooler.dense.weight",
        ),
        (
            {n: t for n, t in tensors.items() if not n.startswith("cls.predictions")},
            {},
            "no MLM head (cls.predictions.*)",
        ),
    ):
        write(broken, **config)
        assert convert(["--from-hf", str(hf_dir), "--save", str(tmp_path / "ck")]) == 1
        assert message in capsys.readouterr().err


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
