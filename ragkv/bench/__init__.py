"""RAG benchmark: a token-level workload generator, an offline mode comparing cache
strategies in one process, and a serving mode driving a running server."""
