"""Self-attention: the core every variant builds (core.py), the mask as data (masks.py), the
backends that run it and the chooser (backends.py; ring.py, softmax.py, sdpa.py; packed
documents by cu_seqlens: varlen.py, varlen_sdpa.py, varlen_cuda.py), and the
variants: multi-head / grouped-query (standard.py), multi-latent (mla.py)."""
