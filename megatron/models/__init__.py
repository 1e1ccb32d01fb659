"""Model families, one folder each: the model, its datasets, forward step and loss, Hugging Face
mapping and evaluation pieces."""
