"""ragkv: an LLM inference engine for retrieval-augmented generation."""

from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .prompt import RAGPrompt
from .sampling import SamplingParams
from .structured_output import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RAGPrompt", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
