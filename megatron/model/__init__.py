"""The transformer building blocks the model families share (megatron/models/<family>/)."""
