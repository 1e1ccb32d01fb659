"""The tokenizer files of a Hugging Face export (megatron/models/gpt/hf_tokenizer.py)."""

from megatron.config.schema import ModelConfig
from megatron.models.gpt.hf_tokenizer import export_tokenizer


def test_a_run_on_gpt2s_builtin_vocab_exports_gpt2s_files(tmp_path):
    # --tokenizer-type GPT2BPETokenizer with no files records none: export the shipped ones.
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=50257)
    tok_args = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": None, "merge_file": None}
    assert export_tokenizer(tok_args, str(tmp_path), None, cfg) == 50256
    assert (tmp_path / "vocab.json").is_file() and (tmp_path / "merges.txt").is_file()
