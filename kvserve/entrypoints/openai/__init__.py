"""The OpenAI-compatible HTTP API: protocol (schemas), one module per endpoint, app (routes), errors."""
