"""The embeddings codec: what a request may hold, and the bytes a response is made of."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
import pytest

from server.config import ModelConfig
from server.openai import codec
from server.openai.errors import InvalidRequest
from server.openai.schemas import MAX_INPUTS, EmbeddingResponse


def body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "minilm", "input": "hello", **fields})


def refusal(raw: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        codec.parse_request(raw)
    return caught.value


def test_a_string_or_a_list_of_strings_is_the_input() -> None:
    assert codec.texts_of(codec.parse_request(body())) == ["hello"]
    assert codec.texts_of(codec.parse_request(body(input=["a", "b"]))) == ["a", "b"]
    parsed = codec.parse_request(body(encoding_format="base64", dimensions=8, user="u"))
    assert (parsed.encoding_format, parsed.dimensions) == ("base64", 8)
    assert codec.parse_request(body()).encoding_format == "float"  # OpenAI's default


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"input": ""}, "input", "'input' is an empty string"),
        ({"input": []}, "input", "'input' is an empty list"),
        ({"input": ["a", ""]}, "input", "input[1] is an empty string"),
        ({"input": [1, 2, 3]}, "input", "arrays of token ids are not supported"),
        ({"input": [[1, 2], [3]]}, "input", "arrays of token ids are not supported"),
        ({"input": ["a", None]}, "input", "input[1] must be a string"),
        ({"input": 5}, "input", "'input' must be a string or a list of strings"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", f"holds {MAX_INPUTS + 1} texts; at most {MAX_INPUTS}"),
        ({"encoding_format": "int8"}, "encoding_format", "'encoding_format'"),
        ({"dimensions": 0}, "dimensions", "'dimensions'"),
        ({"dimensions": 1.5}, "dimensions", "'dimensions'"),
        ({"dimensions": True}, "dimensions", "'dimensions'"),
        ({"dimensions": "8"}, "dimensions", "'dimensions'"),
        ({"model": ""}, "model", "'model'"),
        ({"truncate": True}, "truncate", "unrecognized request argument supplied: truncate"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    error = refusal(body(**fields))
    assert (error.param, words in error.message) == (param, True), error.message


def test_exactly_max_inputs_texts_are_taken() -> None:
    assert len(codec.texts_of(codec.parse_request(body(input=["x"] * MAX_INPUTS)))) == MAX_INPUTS


def test_bodies_that_are_not_a_request_object_are_a_400() -> None:
    assert refusal(b"{not json").message.startswith("the body is not valid JSON")
    assert refusal(b"[]").message == "the body must be a JSON object"
    missing = refusal(orjson.dumps({"input": "x"}))
    assert (missing.param, missing.message) == ("model", "'model' is required")


def test_a_lone_surrogate_is_refused_and_other_text_is_utf8() -> None:
    """JSON can spell one (\\ud800); the parser refuses it, and utf8 would too, naming the item."""
    assert refusal(b'{"model": "m", "input": ["ok", "\\ud800"]}').message.startswith("the body is not valid JSON")
    with pytest.raises(InvalidRequest, match=r"input\[1\] holds a lone surrogate"):
        codec.utf8(["ok", "\ud800"], 64)
    assert codec.utf8(["é", "😀"], 64) == ["é".encode(), "😀".encode()]


def test_a_text_over_the_models_item_limit_is_refused_before_any_is_computed() -> None:
    """Naming the text in the list the client sent, not its place in a chunk."""
    with pytest.raises(InvalidRequest, match=r"input\[2\] is 5 bytes of UTF-8, over the model's max_item_bytes of 4") \
            as caught:
        codec.utf8(["a", "bb", "ccccc", "d"], 4)
    assert caught.value.param == "input"
    assert codec.utf8(["é", "ab"], 2) == ["é".encode(), b"ab"]  # bytes, not characters


def config(matryoshka: list[int] | None) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "emb", "engine": "onnxruntime", "max_batch_size": 8,
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [384]}],
        "preprocess": {"tokenize": {"input": "text"}},
        "openai": {"task": "embeddings", "matryoshka_dimensions": matryoshka},
    })


def test_dimensions_are_refused_for_a_model_without_matryoshka_dimensions() -> None:
    assert codec.target_dimensions(config(None), None) is None
    for asked in (128, 384):  # even its own length: the model takes no 'dimensions' at all
        with pytest.raises(InvalidRequest, match="does not support 'dimensions': it is not Matryoshka") as caught:
            codec.target_dimensions(config(None), asked)
        assert caught.value.param == "dimensions"


def test_dimensions_are_the_declared_ones_or_the_full_length() -> None:
    declared = config([128, 256])
    assert codec.target_dimensions(declared, 128) == 128
    assert codec.target_dimensions(declared, 256) == 256
    assert codec.target_dimensions(declared, 384) is None  # the whole vector: nothing to cut
    with pytest.raises(InvalidRequest, match="serves 'dimensions' 128, 256, 384, not 200"):
        codec.target_dimensions(declared, 200)


def test_truncated_vectors_are_the_prefix_renormalized() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(5, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    short = codec.truncated(vectors, 128)
    assert short.shape == (5, 128) and short.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(short * np.linalg.norm(vectors[:, :128], axis=1, keepdims=True), vectors[:, :128],
                               rtol=1e-5, atol=1e-7)  # the same direction: only the length changed
    assert not np.any(codec.truncated(np.zeros((1, 8), np.float32), 4))  # zero stays zero, no NaN


def test_base64_is_little_endian_float32_and_equals_the_floats() -> None:
    vectors = np.array([[0.1, -2.5, 3e-8], [1.0, 0.0, -0.0]], dtype=np.float32)
    as_floats = EmbeddingResponse.model_validate_json(codec.encode_embeddings(vectors, "float", "m", 9))
    as_base64 = EmbeddingResponse.model_validate_json(codec.encode_embeddings(vectors, "base64", "m", 9))
    for i, (f, b) in enumerate(zip(as_floats.data, as_base64.data, strict=True)):
        assert f.index == b.index == i
        assert isinstance(b.embedding, str)
        raw = base64.b64decode(b.embedding)
        decoded = np.frombuffer(raw, dtype="<f4")  # what OpenAI's client does, on any host
        np.testing.assert_array_equal(decoded, vectors[i])
        np.testing.assert_array_equal(np.array(f.embedding, dtype=np.float32), vectors[i])  # float32 exact
        assert raw == vectors[i].astype("<f4").tobytes()
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == 9
    assert (as_floats.object, as_floats.model) == ("list", "m")


def test_a_model_object_is_openais_shape() -> None:
    assert codec.model_object("minilm", 17) == {"id": "minilm", "object": "model", "created": 17,
                                                 "owned_by": "batchline"}
