"""`kvserve cluster`: N engine replicas on Ray Serve behind one OpenAI-compatible endpoint.

router (prefix affinity, then load; pure), prompt (a request's first block hashes), ingress (the
proxy app), serving (a uvicorn server in a thread), deployments (the Ray Serve application) and
cli. Nothing else in kvserve imports this package; Ray is the optional `cluster` extra.
"""
