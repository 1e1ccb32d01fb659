"""Self-attention: the core every variant builds (core.py), the mask as data (masks.py), the
backends that run it and the chooser (backends.py; ring.py, softmax.py, sdpa.py), and the
variants: multi-head / grouped-query (standard.py), multi-latent (mla.py)."""
