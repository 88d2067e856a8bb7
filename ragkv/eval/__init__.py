"""`ragkv eval`: RAG answer quality of each mode against full prefill."""
