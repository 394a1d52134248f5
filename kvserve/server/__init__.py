"""The OpenAI-compatible HTTP server: `create_app` (kvserve.server.app), the wire protocol
(protocol), Server-Sent Events (sse), Prometheus metrics (metrics) and `kvserve serve` (cli).

Nothing is imported here, so `kvserve serve --help` does not load torch.
"""
