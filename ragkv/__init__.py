"""ragkv: an LLM inference engine for retrieval-augmented generation."""

from .inputs.prompt import RAGPrompt
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling.params import SamplingParams
from .structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RAGPrompt", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
