"""kvserve: an LLM inference-serving engine small enough to read."""

# First, before anything loads torch: OpenMP reads its wait policy once, when torch loads it.
from kvserve.runtime import threads as _threads  # noqa: F401, I001
from kvserve.runtime.heap import collection_paused as _collection_paused

with _collection_paused():  # torch's and transformers' imports: see runtime/heap.py
    from kvserve.entrypoints.llm import LLM
    from kvserve.types import VERSION, RequestOutput, SamplingParams, StructuredOutputs

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputs"]
__version__ = VERSION
