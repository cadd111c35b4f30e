"""Per-GPU-type autotuning and the tuned-config store (``store``, ``space``, ``tuner``,
``gpu_timer``, ``compile_check``, ``gpu_check``), and the cost model: a block's compute
and communication predicted from a plan and a device profile (``cost_model``,
``profiles/``, ``calibrate``), checked against the paper's Table 5 (``table5``)."""
