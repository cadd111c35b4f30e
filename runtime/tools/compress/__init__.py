"""Making decomposed checkpoints worth serving: calibration statistics, data-aware
factorisations (plain SVD, ASVD, SVD-LLM whitening), rank allocation, importers of
other tools' layouts and a fidelity evaluation against the dense model."""
