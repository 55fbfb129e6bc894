"""The OpenAI-compatible HTTP server (FastAPI): app, protocol, metrics, errors, CLI."""
