"""Decomposition: a dense transformers checkpoint into low-rank factors (``decompose``),
calibration statistics, data-aware factorisations (plain SVD, ASVD, SVD-LLM whitening),
rank allocation, importers of other tools' layouts and GGUF, the fidelity evaluation
against the dense model, the demo model (``demo``), and output folders written whole or
not at all (``output``)."""
