"""ragkv: an LLM inference engine for retrieval-augmented generation."""

from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .prompt import RAGPrompt
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RAGPrompt", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
