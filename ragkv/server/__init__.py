"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the same engine as `LLM`."""
