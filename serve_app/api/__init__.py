"""The OpenAI-compatible HTTP API: routes, request and response bodies, errors, metrics."""
