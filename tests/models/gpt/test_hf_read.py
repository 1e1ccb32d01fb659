"""A Hugging Face config.json that does not describe its files (megatron/models/gpt/hf_read.py):
the import names the tensor and what config.json implies, never a bare KeyError or a reshape's
traceback."""

from __future__ import annotations

import json

import pytest

from megatron.models.gpt.hf import from_hf, to_hf
from tests.helpers.checkpoints import VARIANTS, _args, _model, _unpadded

pytest.importorskip("safetensors", reason="HF files are safetensors")


def _export_with(tmp_path, variant: str, **lies) -> str:
    """A tiny model exported, then its config.json changed by `lies`."""
    cfg = VARIANTS[variant]  # 4 layers
    out = str(tmp_path / variant)
    to_hf(_unpadded(_model(cfg), cfg), _args(cfg, 1, 1), out)
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    config.update(lies)
    for key in [k for k, v in lies.items() if v is None]:
        del config[key]
    with open(f"{out}/config.json", "w") as f:
        json.dump(config, f)
    return out


@pytest.mark.parametrize(
    ("variant", "lies", "message"),
    [
        ("gpt2", {"n_layer": 5}, "the files hold no tensor h.4.attn.c_attn.weight that "
         "config.json's 5 layers need (they hold layers 0-3)"),
        ("llama", {"num_hidden_layers": 6}, "the files hold no tensor model.layers.4."
         "self_attn.q_proj.weight that config.json's 6 layers need (they hold layers 0-3)"),
        ("gpt2", {"n_embd": 64}, "tensor wte.weight has shape (70, 32), config.json implies "
         "(70, 64)"),
        # without the check: a reshape's RuntimeError inside the q/k/v join
        ("llama", {"num_key_value_heads": 8}, "tensor model.layers.0.self_attn.k_proj.weight "
         "has shape (32, 64), config.json implies (64, 64)"),
        ("gpt2", {"n_head": None}, "config.json has no 'n_head', which a gpt2 model needs"),
    ],
)  # fmt: skip
def test_a_config_that_lies_about_its_files_is_named(tmp_path, variant, lies, message):
    path = _export_with(tmp_path, variant, **lies)
    with pytest.raises(ValueError) as err:
        from_hf(path)
    assert str(err.value) == f"--from-hf {path}: {message}"
