"""``deinfer serve``: an OpenAI-compatible HTTP server over the engine (``cli``), its
routes (``app``), request admission (``admission``), the engine's background loop
(``engine_loop``), text streaming (``text``, ``generation``), metrics (``metrics``),
and the HTTP serving benchmark (``bench_http``)."""
