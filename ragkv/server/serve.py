"""`ragkv serve`: build the engine, wrap it in the async loop and the HTTP app, run uvicorn."""

from __future__ import annotations

import logging
import os

from ..config import DEFAULT_MAX_BODY_BYTES, EngineConfig
from ..engine.engine import Engine
from .app import ServerConfig, build_app
from .async_engine import AsyncEngine
from .metrics import Metrics

logger = logging.getLogger("ragkv.server")


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, served_model_name: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info") -> None:
    import uvicorn

    api_key = api_key or os.environ.get("RAGKV_API_KEY") or None
    name = served_model_name or config.model
    engine = Engine(config)
    metrics = Metrics(name)
    async_engine = AsyncEngine(engine, on_step=metrics.on_step)
    app = build_app(async_engine, metrics, ServerConfig(name, api_key, max_body_bytes))
    async_engine.start()
    logger.info("serving %s on http://%s:%d (max_model_len=%d)", name, host, port,
                engine.max_model_len)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        async_engine.stop()
