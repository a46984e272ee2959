"""The OpenAI-compatible front end: /v1/embeddings and /v1/models for text-embedding models.

It shares the HTTP port, the access gate and the data plane with KServe v2: a model that
declares `openai: {task: embeddings}` answers both protocols from one queue, so requests of
either share its batches, its statistics and its metrics. This package holds the request and
response models (`schemas`), the codec (`codec`), how a call becomes data-plane requests
(`embeddings`), the error map (`errors`) and the routes (`routes`).
"""

PREFIX = "/v1"
