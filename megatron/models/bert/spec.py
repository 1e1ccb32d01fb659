"""The BERT family's registration (megatron.model.families).

Checkpoints record "bert", or "bert-no-binary-head" for a model without the NSP head; a state
dict is BERT's when it holds the token-type embedding, and headless when it has no pooler.
"""

from __future__ import annotations

from megatron.model.families import ModelSpec, register
from megatron.model.weights import WORD_EMBEDDINGS
from megatron.models.bert import hf, train
from megatron.models.bert.model import BertModel

WITH_NSP, WITHOUT_NSP = "bert", "bert-no-binary-head"


def _family_of_names(names) -> str | None:
    if "embedding.tokentype_embeddings.weight" not in names:
        return None
    return WITH_NSP if "head.pooler.weight" in names else WITHOUT_NSP


def _hf_export(full_state, args, out_dir, tokenizer_files=None) -> str:
    return hf.export_hf_bert(full_state, args, out_dir)  # the vocab travels with the config


SPEC = register(
    ModelSpec(
        name="bert",
        model_provider=train.model_provider,
        datasets_provider=train.datasets_provider,
        forward_step=train.make_forward_step,
        reference_model=lambda cfg, family: BertModel(cfg, binary_head=family == WITH_NSP),
        checkpoint_families=(WITH_NSP, WITHOUT_NSP),
        family_of_names=_family_of_names,
        vocab_sized=(WORD_EMBEDDINGS, "head.lm_bias"),  # the MLM output bias
        hf_export=_hf_export,
        hf_import=hf.import_hf_bert,
        hf_model_types=hf.MODEL_TYPES,
        purpose="train-bert",
    )
)
