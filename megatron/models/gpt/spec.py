"""The GPT family's registration (megatron.model.families)."""

from __future__ import annotations

from megatron.model.families import ModelSpec, register
from megatron.model.weights import OUTPUT_WEIGHTS, WORD_EMBEDDINGS
from megatron.models.gpt import hf, train
from megatron.models.gpt.model import GPTModel


def _hf_export(full_state, args, out_dir, tokenizer_files=None) -> str:
    arch = hf.to_hf(full_state, args, out_dir, tokenizer_files=tokenizer_files)
    names = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
    names.update(mixtral="MixtralForCausalLM", qwen2_moe="Qwen2MoeForCausalLM")
    names.update(deepseek_v3="DeepseekV3ForCausalLM")
    return names[arch]


def _deepspeed_pipeline(cfg, rt, checkpoint_fn):
    from megatron.models.gpt.deepspeed_pipe import build_pipeline_module

    return build_pipeline_module(cfg, rt, checkpoint_fn)


SPEC = register(
    ModelSpec(
        name="gpt",
        model_provider=train.model_provider,
        datasets_provider=train.datasets_provider,
        forward_step=train.make_forward_step,
        reference_model=lambda cfg, family: GPTModel(cfg),
        checkpoint_families=("gpt",),
        family_of_names=lambda names: "gpt",
        vocab_sized=(WORD_EMBEDDINGS, OUTPUT_WEIGHTS),
        deepspeed_pipeline=_deepspeed_pipeline,
        hf_export=_hf_export,
        hf_import=lambda hf_dir, hf_config: hf.from_hf(hf_dir),
        hf_model_types=("gpt2", "llama", "mixtral", "qwen2_moe", "deepseek_v3"),
        causal_lm=True,
        purpose="train-gpt",
    )
)
