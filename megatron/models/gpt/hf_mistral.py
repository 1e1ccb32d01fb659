"""Hugging Face MistralForCausalLM: Llama's layer (RoPE, RMSNorm, SwiGLU, GQA) with one sliding
window on every layer, its tensors named as Llama's (megatron.models.gpt.hf).

HF's `sliding_window` W counts the query itself: query i sees keys j with i - W < j <= i, which
is our --window-size W-1,0. A window that covers all of max_position_embeddings imports as a
global model (equal logits). Windows on some layers only (Gemma 3, gpt-oss) and attention sinks
have no twin here yet: refused with the reason rather than exported without them.
"""

from __future__ import annotations

from megatron.config.schema import ModelConfig

ARCH = "mistral"


def window_architecture(cfg: ModelConfig, llama: list[str]) -> str:
    """'mistral' for a windowed model that is Llama's shape (`llama`: the flags Llama's shape
    still needs); ValueError otherwise."""
    if cfg.moe or cfg.multi_latent_attention:
        raise ValueError(
            "no Hugging Face architecture here takes --window-size with experts or multi-latent "
            "attention (gpt-oss's and DeepSeek-V4's twins are not implemented)"
        )
    if not all(cfg.window_layers):
        raise ValueError(
            "--window-attn-skip-freq: windows on some layers only (Gemma 3, gpt-oss) have no "
            "Hugging Face twin here yet; MistralForCausalLM windows every layer"
        )
    if llama:
        raise ValueError(f"MistralForCausalLM would need {', '.join(llama)}")
    return ARCH


def refuse_sinks(cfg: ModelConfig) -> None:
    if cfg.softmax_type != "vanilla":
        raise ValueError(
            f"--softmax-type {cfg.softmax_type}: attention sinks have no Hugging Face twin here "
            "yet (GptOssForCausalLM's is not implemented), so no export computes these logits"
        )


def mistral_hf_config(cfg: ModelConfig, llama: dict) -> dict:
    """config.json of a MistralForCausalLM: Llama's, with the window."""
    out = {**llama, "architectures": ["MistralForCausalLM"], "model_type": ARCH}
    out["sliding_window"] = cfg.window[0] + 1
    return out


def mistral_fields(hf_cfg: dict, seq_length: int) -> dict:
    """The window fields of a Mistral config.json (none when it has no window, or one that
    covers every position: global attention)."""
    width = hf_cfg.get("sliding_window")
    if width is None or width >= seq_length:
        return {}
    if width < 1:
        raise ValueError(f"config.json sliding_window={width!r}: a window holds the query")
    return {"window_size": f"{width - 1},0"}
