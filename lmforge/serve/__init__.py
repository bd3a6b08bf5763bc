"""Serving: an OpenAI-compatible HTTP API with a chat page, SageMaker's container routes, and
metrics, over the continuous-batching engine (lmforge.inference.engine). `lmforge serve
MODEL_DIR` runs it; `lmforge.serve.app.create_app` builds the ASGI app. Nothing is imported here,
so `lmforge --help` does not load torch or FastAPI."""
