"""kvserve: an LLM inference-serving engine small enough to read."""

from kvserve.entrypoints.llm import LLM
from kvserve.types import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
