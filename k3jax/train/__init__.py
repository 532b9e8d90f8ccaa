"""Training: per-head Muon + AdamW, QK-Clip, MTP, Quantile Balancing, orbax checkpoints, the CLI."""
