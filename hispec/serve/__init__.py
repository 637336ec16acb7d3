"""Serving: continuous batching over the speculative decoder (`engine`), a paged KV store (`paged`) and an
OpenAI-compatible HTTP server (`server`, needs the `serve` extra: fastapi, uvicorn)."""

from .engine import Engine, EngineError, Handle, Request
from .paged import PAGED_UNAVAILABLE, KVPoolFull, PagedKVCache, PagedKVStore, PagedKVUnavailable

__all__ = ["Engine", "EngineError", "Handle", "Request", "KVPoolFull", "PagedKVCache", "PagedKVStore",
           "PagedKVUnavailable", "PAGED_UNAVAILABLE"]
