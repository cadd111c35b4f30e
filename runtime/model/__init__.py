"""One rank's model: checkpoint format and sliced reading (``checkpoint``, ``weights``),
factor sharding by the plan (``shard``), the decoder layers of each mode (``layers``),
embedding / layers / LM head (``transformer``), RoPE and the two attention paths
(``rope``, ``attention``, ``eager_attention``)."""
