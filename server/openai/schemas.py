"""OpenAI's request and response bodies, as pydantic models: the request is validated with
them, and the OpenAPI document shows them. Responses are written by `codec` with orjson (a
vector of 384 floats per text is too many for a model per element), in these shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

MAX_INPUTS = 2048  # OpenAI's own bound on the texts of one call


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings. Unknown fields are refused, as OpenAI refuses them."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] = Field(
        description=f"The text to embed, or a list of up to {MAX_INPUTS} texts; none of them empty. "
        "Arrays of token ids are not accepted: send the text.",
    )
    model: str = Field(min_length=1, description="A model of GET /v1/models")
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: each vector as little-endian float32 bytes, base64-encoded"
    )
    dimensions: int | None = Field(
        default=None, gt=0, strict=True,  # not true, 3.0 or "3": OpenAI takes an integer
        description="Shorter vectors, for a model that declares Matryoshka dimensions (re-normalized)",
    )
    user: str | None = Field(default=None, description="Accepted and ignored")

    @field_validator("input", mode="before")
    @classmethod
    def _texts(cls, value: object) -> object:
        """Clear words for what OpenAI accepts and this server does not (token ids), and for
        empty or too many texts, before pydantic's generic union messages."""
        if isinstance(value, str):
            if not value:
                raise _invalid("'input' is an empty string: send the text to embed")
            return value
        if not isinstance(value, list):
            raise _invalid("'input' must be a string or a list of strings")
        if not value:
            raise _invalid("'input' is an empty list: send at least one text")
        if len(value) > MAX_INPUTS:
            raise _invalid(f"'input' holds {len(value)} texts; at most {MAX_INPUTS} per call")
        for i, item in enumerate(value):
            if isinstance(item, str):
                if not item:
                    raise _invalid(f"input[{i}] is an empty string: every text must hold something to embed")
                continue
            if isinstance(item, (int, list)) and not isinstance(item, bool):
                raise _invalid("arrays of token ids are not supported: send the texts themselves")
            raise _invalid(f"input[{i}] must be a string")
        return value


def _invalid(message: str) -> PydanticCustomError:
    """A refusal of 'input' in these words, not pydantic's ("Value error, ..." and the like)."""
    return PydanticCustomError("invalid_input", message)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(description="The position of its text in 'input'")
    embedding: list[float] | str = Field(description="The vector; a base64 string with encoding_format base64")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens the model read, as its tokenizer counts them (special tokens "
                               "included, after truncation at the model's max_length)")
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="When the served version was written to the repository (Unix seconds)")
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body, sent with every error status of the /v1 routes."""

    error: ErrorDetail
