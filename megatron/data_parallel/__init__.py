"""Data parallelism: our DDP (fp32 gradient buckets reduced during backward) and torch's FSDP2
behind the same interface. Imports config.schema and mpu only."""
