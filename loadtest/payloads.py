"""KServe v2 request bodies for the default models, and the check of their responses.

One place builds JSON and binary (Triton binary tensor extension) bodies so that locust, wrk and
the open-loop client send the very same bytes, and one place checks a reply, so that a "fast"
server that answers garbage is counted as failing.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from loadtest import mlp
from server.layout import FIRST_VERSION, version_dir

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
HEADER_LENGTH = "Inference-Header-Content-Length"

# Varied on purpose (length, language, punctuation, numbers, emoji): minilm pads a batch to its
# longest text, so uniform short strings would flatter the server.
SENTENCES: tuple[str, ...] = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password?",
    "Batch inference trades a little latency for a lot of throughput.",
    "Paris is the capital of France.",
    "What is the weather like in Tokyo tomorrow morning?",
    "I can't believe it's already December!",
    "Dynamic batching groups requests that arrive close together.",
    "A man is playing a guitar on a street corner while people walk past.",
    "Die Katze sitzt auf der Matte.",
    "¿Dónde está la estación de tren más cercana?",
    "Le chat dort sur le canapé depuis ce matin.",
    "数据科学是一门跨学科的领域。",
    "Order #48213 shipped on 2024-03-05 and arrives in 3-5 business days.",
    "ok 👍",
    "The mitochondria is the powerhouse of the cell.",
    ("Please summarise the quarterly report in three bullet points, focusing on revenue, costs, "
    "and the outlook for the next two quarters."),
    "Error: connection refused (errno 111) while contacting 10.0.0.7:5432",
    "She sells sea shells by the sea shore.",
    "Transformers use self-attention to weigh the relevance of every token to every other token.",
    "Why is the sky blue?",
    "Two dogs are running through a field of tall grass.",
    ("The committee postponed its decision until more data on the long-term effects of the policy "
    "could be collected, analysed and independently reviewed by at least two outside experts."),
    "Buy milk, eggs, bread.",
    "In 1969, Apollo 11 landed the first humans on the Moon.",
    "This product is terrible; it broke after two days and support never answered.",
    "Absolutely love it — best purchase I've made all year!",
    "def add(a, b): return a + b",
    "The train to Amsterdam departs from platform 4 at 17:45.",
    "Quantum computers exploit superposition and entanglement.",
    ("Can you recommend a good book about the history of mathematics, preferably one that explains "
    "the ideas rather than just the biographies of the people involved?"),
    "yes",
    ("Renewable energy capacity grew faster than expected last year, driven mostly by solar panels "
    "installed on rooftops and in large utility-scale parks, while wind lagged behind because of "
    "supply-chain problems, higher interest rates and long permitting delays in several countries; "
    "analysts nevertheless expect both to keep growing for the rest of the decade as costs fall."),
    "Meeting moved to Thursday.",
    "A woman is slicing tomatoes in a kitchen.",
    "Is it safe to eat raw cookie dough?",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "The stock market fell 3% after the announcement.",
    "Translate 'good morning' into Italian.",
    "Inference servers queue requests per model version and run them on a pool of instances.",
)

# name of the input, its datatype, the output and its width per item
SPECS: dict[str, tuple[str, str, str, int]] = {
    "digits": ("image", "FP32", "probabilities", 10),
    "minilm": ("text", "BYTES", "embedding", 384),
    "mlp": ("x", "FP32", "scores", 10),  # the per-request cost benchmark's model (loadtest/mlp.py)
}


@dataclass(frozen=True)
class InferRequest:
    """One ready-to-send infer request: path, headers and body bytes."""

    model: str
    items: int
    binary: bool
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@lru_cache(maxsize=4)
def digits_images(repository: Path = MODELS) -> np.ndarray:
    """The held-out digits images, FP32 [n,1,8,8] (written by models/digits/build.py)."""
    path = version_dir(repository / "digits", FIRST_VERSION) / "heldout.npz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; build the models first (`make models`)")
    with np.load(path) as data:
        return np.ascontiguousarray(data["images"], dtype=np.float32)


def items_for(model: str, items: int, offset: int, repository: Path = MODELS) -> np.ndarray:
    """`items` inputs for `model`, starting at `offset` in its sample set (wrapping around)."""
    if model == "digits":
        images = digits_images(repository)
        index = (np.arange(items) + offset) % len(images)
        return images[index]
    if model == "mlp":
        return mlp.items(items, offset)
    if model == "minilm":
        texts = [SENTENCES[(offset + i) % len(SENTENCES)] for i in range(items)]
        return np.array(texts, dtype=object).reshape(items, 1)
    raise ValueError(f"unknown model {model!r}; known: {', '.join(SPECS)}")


DEFAULT_BODIES = 32  # the distinct bodies a bench mode sends in turn (--bodies)


def texts_sent(bodies: int = DEFAULT_BODIES) -> list[str]:
    """The texts `bench closed --model minilm --bodies N` sends (at one item a request), in body
    order: an engine benchmark read against that load must time these, not all of SENTENCES."""
    return [str(text) for text in items_for("minilm", bodies, 0).reshape(-1)]


def _bytes_elements(array: np.ndarray) -> bytes:
    parts = []
    for text in array.reshape(-1):
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def build_request(
    model: str, items: int = 1, binary: bool = False, offset: int = 0, repository: Path = MODELS
) -> InferRequest:
    """An infer request with `items` inputs. Binary bodies also ask for a binary output."""
    if items < 1:
        raise ValueError("items must be >= 1")
    input_name, datatype, output_name, _ = SPECS[model]
    data = items_for(model, items, offset, repository)
    tensor: dict = {"name": input_name, "shape": list(data.shape), "datatype": datatype}
    path = f"/v2/models/{model}/infer"
    if not binary:
        tensor["data"] = [str(t) for t in data.reshape(-1)] if datatype == "BYTES" else data.reshape(-1).tolist()
        body = json.dumps({"inputs": [tensor]}, separators=(",", ":"), ensure_ascii=False).encode()
        return InferRequest(model, items, False, path, body, {"Content-Type": "application/json"})
    raw = _bytes_elements(data) if datatype == "BYTES" else data.astype("<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json.dumps(
        {"inputs": [tensor], "outputs": [{"name": output_name, "parameters": {"binary_data": True}}]},
        separators=(",", ":"),
    ).encode()
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return InferRequest(model, items, True, path, header + raw, headers)


def build_requests(
    model: str, items: int, binary: bool, count: int, repository: Path = MODELS
) -> list[InferRequest]:
    """`count` different requests (different samples), so caches and padding see variety."""
    return [build_request(model, items, binary, offset=i * items, repository=repository) for i in range(count)]


def check_response(model: str, items: int, status: int, headers: dict[str, str], body: bytes) -> str | None:
    """None when the reply is a 200 with one output of shape [items, width]; else why not."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    _, _, output_name, width = SPECS[model]
    lowered = {k.lower(): v for k, v in headers.items()}
    header_length = lowered.get(HEADER_LENGTH.lower())
    try:
        header = json.loads(body[: int(header_length)] if header_length is not None else body)
    except (ValueError, TypeError) as exc:
        return f"reply is not JSON: {exc}"
    outputs = header.get("outputs") or []
    match = [o for o in outputs if o.get("name") == output_name]
    if not match:
        return f"no output {output_name!r} in reply: {[o.get('name') for o in outputs]}"
    output = match[0]
    if output.get("shape") != [items, width]:
        return f"output shape {output.get('shape')}, expected {[items, width]}"
    expected = items * width
    if header_length is not None:
        size = (output.get("parameters") or {}).get("binary_data_size")
        if size != expected * 4 or len(body) - int(header_length) != size:
            return f"binary output of {size} bytes (body tail {len(body) - int(header_length)}), expected {expected * 4}"
    elif len(output.get("data") or []) != expected:
        return f"output holds {len(output.get('data') or [])} values, expected {expected}"
    return None
