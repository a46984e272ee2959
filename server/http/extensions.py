"""The protocols the HTTP port serves beside KServe v2, each declared by its own package: adding
one is that package plus one line here."""

from __future__ import annotations

from server.asgi.extension import HttpExtension
from server.openai.extension import OPENAI

EXTENSIONS: tuple[HttpExtension, ...] = (OPENAI,)
