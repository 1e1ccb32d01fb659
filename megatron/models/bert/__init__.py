"""The BERT family: bidirectional encoder, masked-LM + next-sentence-prediction loss."""
