"""OpenAI-compatible HTTP API on Litestar (routes, schemas, errors)."""
