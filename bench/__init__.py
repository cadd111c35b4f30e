"""Benchmarks: the engine against transformers, the dense model and the weight-streaming
floor (``runner``, ``config``, ``variants``, ``measure``, ``baseline``, ``ratios``,
``report``), behind emulated links with the cost model's predictions (``link_planner``,
``link_report``), serving through HTTP (``http``, ``serve``, ``serve_report``) and
hostile requests beside a stream (``hostile``)."""
