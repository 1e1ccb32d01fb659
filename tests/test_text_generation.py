"""Greedy generation picks the argmax of the real-vocab logits and stops at end-of-document."""

import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu import single_process_state
from megatron.text_generation import generate_greedy

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=50,
    make_vocab_size_divisible_by=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def test_greedy_equals_a_manual_argmax_loop_and_never_picks_padding():
    model = GPTModel(CFG, single_process_state(), seed=3)
    prompt = [1, 2, 3]
    got = generate_greedy(model, prompt, 8, max_length=CFG.seq_length)
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([expected[-CFG.seq_length :]]))[0, -1, : CFG.vocab_size]
            expected.append(int(logits.argmax()))
    assert got == expected and all(t < CFG.vocab_size for t in got)


def test_generation_stops_after_eod():
    model = GPTModel(CFG, single_process_state(), seed=3)
    first = generate_greedy(model, [1, 2, 3], 1)[-1]
    assert generate_greedy(model, [1, 2, 3], 10, eod=first) == [1, 2, 3, first]
