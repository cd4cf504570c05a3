"""What the gateway records and shows: the request span and metrics, the OTLP trace store, the dashboard."""
