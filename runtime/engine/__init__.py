"""The serving engine: ``LLM`` (``llm``) drives the scheduler (``scheduler``,
``block_manager``, ``sequence``) and one ``ModelRunner`` per rank (``model_runner``) with
its paged KV cache (``kv_cache``), static CUDA-graph decode (``static_decode``) and
batched sampling (``sampling``)."""

from runtime.engine.llm import LLM
from runtime.engine.outputs import RequestOutput, StreamEvent
from runtime.engine.sequence import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent"]
