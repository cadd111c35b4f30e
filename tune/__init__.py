"""Per-GPU-type autotuning and the tuned-config store."""
