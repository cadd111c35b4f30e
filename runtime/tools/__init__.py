"""Helpers built on the engine that other rooms share: random checkpoints of a spec's
shapes (``random_checkpoint``) and the transformers reference model holding a
checkpoint's products (``hf_reference``)."""
