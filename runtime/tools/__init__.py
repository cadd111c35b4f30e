"""Tools built on the engine: checkpoint decomposition (``decompose``, ``compress``),
random checkpoints (``random_checkpoint``), the transformers reference model
(``hf_reference``), the demo (``demo``) and the benchmarks (``bench``)."""
