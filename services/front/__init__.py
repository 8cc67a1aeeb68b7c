"""The OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions over the
routers' gRPC contract (services/front/app.py)."""
