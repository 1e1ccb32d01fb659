"""Writing the weight file of a Hugging Face folder (`--to-hf`)."""

from __future__ import annotations

import os


def save_safetensors(tensors: dict, path: str) -> None:
    """`model.safetensors` readable as any file the user writes (0644 under the usual umask):
    safetensors writes through a private temporary file, which leaves it 0600, so a shared
    model folder or a web server could not read the weights."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
