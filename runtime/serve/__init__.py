"""The OpenAI-compatible HTTP server over the engine: its routes (``app``), request
admission (``admission``), the engine's background loop (``engine_loop``), text
streaming (``text``, ``generation``), Prometheus metrics (``metrics``) and the request
and response models (``protocol``). ``cli.serve`` starts it."""
