"""The OpenAI-compatible HTTP server: FastAPI app, schemas, streaming, parsing, metrics."""
