"""The serving layer: an OpenAI-compatible HTTP app (app.py) and its command (server.py), the engine stepping in its own thread
beside the event loop (async_engine.py), request bodies (protocol.py), chat rendering with images (chat.py),
Prometheus metrics (metrics.py)."""
