"""What pretrain_bert.py's model cannot do (refused by flag), and the BERT section's flags that
pretrain_gpt2.py refuses."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.schema import MegatronConfig
from megatron.schedules.one_f_one_b import ONE_F_ONE_B


def validate_bert(cfg: MegatronConfig) -> None:
    """pretrain_bert.py's rules: what its model cannot do."""
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        fail(
            "--num-layers-per-virtual-pipeline-stage",
            "BERT runs one model chunk per pipeline stage",
            "drop the flag",
        )
    if cfg.parallel.pipeline_schedule is not None and cfg.parallel.schedule is not ONE_F_ONE_B:
        fail(
            "--pipeline-schedule",
            "pretrain_bert.py runs the 1F1B schedule only",
            f"drop the flag (or --pipeline-schedule {ONE_F_ONE_B})",
        )
    m = cfg.model
    for flag, given, why, fix in (
        (
            "--context-parallel-size",
            cfg.parallel.context_parallel_size > 1,
            "ring attention is causal (the GPT's); BERT attends both ways over its padded samples",
            "drop it (BERT's 512-token samples fit on one rank)",
        ),
        (
            "--sequence-parallel",
            cfg.parallel.sequence_parallel,
            "the BERT model does not split its embeddings, pooler and heads along the sequence",
            "drop it (BERT-large fits without it; TP alone splits the layers)",
        ),
        (
            "--num-unique-layers",
            m.num_unique_layers is not None,
            "layer sharing is built into the GPT's layer stack only",
            "drop it, or pretrain a GPT with pretrain_gpt2.py",
        ),
        (
            "--untie-embeddings-and-output-weights",
            m.untie_embeddings_and_output_weights,
            "BERT ties its MLM output",
            "drop it",
        ),
        (
            "--num-experts",
            m.moe,
            "mixture of experts is trained, logged and converted for the GPT only",
            "drop it, or pretrain an MoE GPT with pretrain_gpt2.py",
        ),
        (
            "--mtp-num-layers",
            m.mtp_num_layers is not None,
            "multi-token prediction is built into the GPT only",
            "drop it, or pretrain a GPT with pretrain_gpt2.py",
        ),
        (
            "--cross-entropy-fusion-impl",
            cfg.kernels.cross_entropy_fusion_impl != "native",
            "the fused output layer + loss is the GPT's; BERT's MLM head adds a bias and a "
            "transform of its own",
            "drop it (or give native)",
        ),
        (
            "--sequence-packing",
            cfg.data.sequence_packing != "concat",
            "packs GPT samples; BERT's sentence-pair samples are not packed yet",
            "drop it (or give concat)",
        ),
        (
            "--reset-position-ids/--reset-attention-mask/--eod-mask-loss",
            cfg.data.uses_documents,
            "GPT's packed-document options; BERT samples hold one document",
            "drop them",
        ),
    ):
        if given:
            fail(flag, why, fix)


def refuse_bert_settings(cfg: MegatronConfig) -> None:
    """pretrain_gpt2.py: the BERT section's flags do nothing for a GPT, so they are refused."""
    if cfg.bert.changed:
        fail(
            cfg.bert.changed[0],
            "a BERT pretraining setting; the GPT has no masked-LM or NSP objective",
            "drop it, or run pretrain_bert.py",
        )
