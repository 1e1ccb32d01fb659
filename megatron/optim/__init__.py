"""The optimizer stack: one step (inf/NaN skip, clipping, the update, the copy back, the loss
scale) over fp32 pieces that live where the backend keeps them (plain: whole parameters;
--use-distributed-optimizer: this DP rank's shard of the gradient buckets; --use-torch-fsdp2:
FSDP2's shards), and the torch optimizer built by name from megatron.config.optimizers."""
