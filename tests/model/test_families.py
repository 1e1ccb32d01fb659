"""The family table the trainer, checkpoint and inference code read (megatron/model/families.py)."""

import pytest

from megatron.model import families


def test_a_registered_family_is_found_by_name_and_by_its_checkpoints(monkeypatch):
    monkeypatch.setattr(families, "_REGISTERED", dict(families._REGISTERED))
    mine = families.ModelSpec(
        name="mine",
        model_provider=None,
        datasets_provider=None,
        forward_step=None,
        reference_model=None,
        checkpoint_families=("mine",),
        family_of_names=lambda names: "mine" if "mine.weight" in names else None,
        vocab_sized=("mine.weight",),
    )
    with pytest.raises(ValueError, match="unknown model family 'mine'.*register"):
        families.get_spec("mine")
    assert families.register(mine) is mine
    assert families.get_spec("mine") is mine and families.family_names()[-1] == "mine"
    assert families.checkpoint_family({"mine.weight"}) == "mine"
    assert families.spec_of_checkpoint_family("mine") is mine
    assert "mine.weight" in families.vocab_sized_names()
    # The built-in families load on first use, without their entry points.
    assert families.checkpoint_family({"embedding.word_embeddings.weight"}) == "gpt"
    assert families.spec_of_checkpoint_family(None).name == families.DEFAULT_FAMILY
