"""Benchmarks: the engine against transformers and the weight-streaming floor
(``runner``, ``config``, ``baseline``, ``report``, ``link_report``) and serving through
HTTP (``http``, ``serve``, ``serve_report``)."""
