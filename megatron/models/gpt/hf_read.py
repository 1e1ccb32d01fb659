"""The safetensors of a Hugging Face directory, as the importers (megatron.models.gpt.hf) pop them.

A config.json that does not describe its files (more layers than they hold, another width) is
named here, at the tensor: "the files hold no tensor X that config.json's N layers need", or
"tensor X has shape A, config.json implies B", instead of a bare KeyError or a reshape's
traceback further on.
"""

from __future__ import annotations

import json
import os
import re

import torch

_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


class HFTensors(dict):
    """name -> tensor of the files. `pop(name)` without a default raises ValueError naming a
    tensor that is not there; any pop raises it for a tensor whose shape is not the one
    `shapes` (HF name -> the shape config.json implies) gives."""

    def __init__(self, tensors: dict, shapes: dict, where: str, num_layers: int):
        super().__init__(tensors)
        self.shapes, self.where, self.num_layers = shapes, where, num_layers
        self.layers_held = {_layer_of(n) for n in tensors} - {None}

    def pop(self, name, *default):
        if name not in self:
            if default:
                return default[0]
            raise ValueError(self._missing(name))
        tensor = super().pop(name)
        want = self.shapes.get(name)
        if want is not None and tuple(tensor.shape) != want:
            raise ValueError(
                f"{self.where}: tensor {name} has shape {tuple(tensor.shape)}, config.json "
                f"implies {want}"
            )
        return tensor

    def _missing(self, name: str) -> str:
        if _layer_of(name) is None:
            return f"{self.where}: the files hold no tensor {name} that config.json needs"
        held = self.layers_held
        have = f"they hold layers 0-{max(held)}" if held else "they hold no layer"
        return (
            f"{self.where}: the files hold no tensor {name} that config.json's "
            f"{self.num_layers} layers need ({have})"
        )


def read_safetensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"--from-hf {hf_dir}: no model.safetensors (or its index); only safetensors weights "
            "are read (convert a pytorch_model.bin with transformers' save_pretrained first)"
        )
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(hf_dir, name)))
    return tensors


def not_accounted_for(left: list[str], hf_cfg: dict) -> str:
    """What is wrong with the tensors an import left: layers config.json does not count (it
    under-reports num_hidden_layers: imported, the model would be silently truncated), else
    names not understood."""
    indices = {int(m[1]) for n in left if (m := re.match(r"(?:model\.layers|h)\.(\d+)\.", n))}
    key = "n_layer" if "n_layer" in hf_cfg else "num_hidden_layers"  # GPT-2's spelling
    layers = sorted(i for i in indices if i >= hf_cfg[key])
    if not layers:
        return f"tensors not understood: {', '.join(left[:6])}"
    counted = f"{key} ({hf_cfg[key]})"
    if "num_nextn_predict_layers" in hf_cfg:  # DeepSeek: the MTP depths it announces
        counted += f" and num_nextn_predict_layers ({hf_cfg['num_nextn_predict_layers']})"
    return (
        f"the files hold layer(s) {', '.join(map(str, layers))} that config.json's {counted} "
        f"do not account for (e.g. {left[0]}). Fix: correct config.json's layer count"
    )
