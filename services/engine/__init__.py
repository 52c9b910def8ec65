"""The Coxswain inference engine: paged KV, prefix caching, continuous batching, sampling."""

from services.engine.async_llm import AsyncLLM
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import (
    CompletionDelta,
    CompletionOutput,
    OutputAccumulator,
    RequestDelta,
    RequestOutput,
)
from services.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionDelta",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "OutputAccumulator",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
]
