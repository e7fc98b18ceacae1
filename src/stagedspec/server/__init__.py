"""`stagedspec serve`: an OpenAI-compatible HTTP server over exact speculative decoding.

Needs the `serve` extra (fastapi, uvicorn); nothing in the core imports this
package, and the CLI imports it only when the `serve` command runs.

- `schemas`: request parsing and the OpenAI error shape;
- `engine`: the loaded models, per-request speculation and the memory model;
- `scheduler`: continuous batching on one worker thread, exact per request;
- `text`: token ids -> streamed text with stop strings;
- `metrics`: Prometheus text;
- `guard`: the Host and Origin checks (safe on loopback) and CORS;
- `app`: the FastAPI routes.
"""
