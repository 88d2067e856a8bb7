"""ragkv: an LLM inference engine for retrieval-augmented generation."""

from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
