"""BERT training step time: our single-process stack against transformers' BertForPreTraining.

    .venv/bin/python bench/bert_step.py [--layers 4 --hidden 256 --heads 4 --seq 128
                                         --vocab 8192 --batch 8 --steps 10 --rounds 3]

Both sides train the same shape (post-LN, GeLU, MLM + NSP heads, dropout 0) on the same
random batches (15% of the tokens predicted, 10% padding) in one process, alternating rounds:
ours = BertModel + DistributedDataParallel (fp32 main_grad buffer) + MegatronOptimizer (AdamW,
global clip, inf check) + AnnealingLR through train_step(); HF = BertForPreTraining (its
default attention) + torch AdamW + clip_grad_norm_. Prints the median step times and the ratio
HF / ours (>= 1 means ours is faster).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_step import build_ours, median_step_times  # noqa: E402
from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.models.bert import model as bert  # noqa: E402
from megatron.models.bert.hf import hf_bert_config  # noqa: E402
from megatron.models.bert.train import bert_loss  # noqa: E402


def _batches(args, device):
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        b, s = args.batch, args.seq
        tokens = torch.randint(5, args.vocab, (b, s), generator=g)
        types = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous()
        pad = torch.ones(b, s, dtype=torch.long)
        pad[:, s - s // 10 :] = 0
        chosen = (torch.rand(b, s, generator=g) < 0.15) & pad.bool()
        labels = torch.where(chosen, tokens, torch.zeros_like(tokens))
        nsp = torch.randint(0, 2, (b,), generator=g)
        data.append(tuple(t.to(device) for t in (tokens, types, pad, labels, chosen, nsp)))
    while True:
        yield from data


def build_hf(cfg: ModelConfig, device):
    from transformers import BertForPreTraining

    model = BertForPreTraining(hf_bert_config(cfg)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(batches):
        tokens, types, pad, labels, chosen, nsp = next(batches)
        mlm_labels = torch.where(chosen, labels, torch.full_like(labels, -100))
        opt.zero_grad(set_to_none=True)
        out = model(
            input_ids=tokens,
            token_type_ids=types,
            attention_mask=pad,
            labels=mlm_labels,
            next_sentence_label=nsp,
        )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def _bert_forward_step(batches, model):
    tokens, types, pad, labels, chosen, nsp = next(batches)
    output = model(tokens, pad, types, labels)
    return output, lambda out: bert_loss(chosen.float(), nsp, out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("seq", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("vocab", 8192), ("batch", 8), ("steps", 10), ("rounds", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        vocab_size=args.vocab,
        make_vocab_size_divisible_by=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-12,
        apply_residual_connection_post_layernorm=True,
    )
    steps = {
        "ours": build_ours(
            cfg, device, torch.float32, builder=bert.build_bert_model, fwd=_bert_forward_step
        ),
        "hf": build_hf(cfg, device),
    }
    times = median_step_times(steps, _batches(args, device), args.rounds, args.steps, device)
    ours, hf = times["ours"], times["hf"]
    shape = f"L{args.layers} h{args.hidden} heads{args.heads} s{args.seq} b{args.batch}"
    print(f"BERT {shape} vocab {args.vocab} fp32 on {device.type}")
    print(f"  ours {1000 * ours:.1f} ms/step, HF BertForPreTraining {1000 * hf:.1f} ms/step")
    print(f"  ratio HF / ours = {hf / ours:.2f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
