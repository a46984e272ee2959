"""OpenAI's /v1 as the HTTP front end mounts it: its routes, its refusal body and its part of
the OpenAPI document."""

from __future__ import annotations

from server.asgi.extension import HttpExtension
from server.openai import PREFIX
from server.openai.errors import refusal_body
from server.openai.openapi import ERROR_SCHEMA, ERROR_STATUSES, component_schemas
from server.openai.routes import openai_router

OPENAI = HttpExtension(
    prefix=PREFIX,
    router=openai_router,
    refusal_body=refusal_body,
    error_statuses=ERROR_STATUSES,
    error_schema=ERROR_SCHEMA,
    component_schemas=component_schemas,
)
