"""The serving engine: ``LLM`` (``llm``), configured by one ``EngineOptions``
(``config``, which also resolves what the options come to on this machine), drives the
scheduler (``scheduler``, ``block_manager``, ``sequence``) and one ``ModelRunner`` per
rank (``model_runner``) with its paged KV cache (``kv_cache``), attention over it
(``cache_attention``), static CUDA-graph decode (``static_decode``) and batched sampling
(``sampling``)."""

from runtime.engine.config import EngineOptions
from runtime.engine.llm import LLM
from runtime.engine.outputs import RequestOutput, StreamEvent
from runtime.engine.sequence import SamplingParams

__all__ = ["LLM", "EngineOptions", "RequestOutput", "SamplingParams", "StreamEvent"]
