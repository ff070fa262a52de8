"""The serving layer: an OpenAI-compatible HTTP server (server.py), the engine stepping in its own thread
beside the event loop (async_engine.py), request bodies (protocol.py), chat rendering with images (chat.py),
Prometheus metrics (metrics.py)."""
