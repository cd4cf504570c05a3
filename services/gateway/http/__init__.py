"""The OpenAI-compatible HTTP surface: parsing and validating bodies, admission, answers as JSON or SSE,
incremental detokenisation, and the one mapping from exception to HTTP error."""
