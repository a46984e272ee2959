"""The data plane every front end shares: KServe v2 operations over the model repository.

Front ends (HTTP today) only move bytes and statuses; what each operation means lives here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from server import __version__
from server.config import ModelConfig
from server.errors import InvalidInput, Unavailable
from server.protocol.triton_config import triton_model_config, triton_platform
from server.protocol.v2 import DecodedRequest, decode_request, encode_response
from server.repository import ModelRepository
from server.scheduler.request import RequestRecord

# Bodies and outputs larger than this are decoded / encoded on a worker thread, so one big
# request never stalls the event loop that every other request shares.
OFFLOAD_BYTES = 1 << 20

EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "model_repository",
    "statistics",
]


class DataPlane:
    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository
        self._startup: asyncio.Task[None] | None = None

    def start(self, models: list[str] | None = None) -> None:
        """Begin loading models in the background: the server is live at once, ready later."""
        self._startup = asyncio.create_task(self.repository.load_all(models))

    async def stop(self) -> None:
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        await self.repository.unload_all()

    @staticmethod
    def server_metadata() -> dict[str, Any]:
        return {"name": "batchline", "version": __version__, "extensions": EXTENSIONS}

    def server_live(self) -> bool:
        """False once a model lost every instance to a hung engine: only a restart frees them."""
        return self.repository.live()

    def server_ready(self) -> bool:
        return self._startup is not None and self._startup.done() and self.repository.all_ready()

    def model_ready(self, name: str, version: str | None) -> bool:
        try:
            return self.repository.get(name, version).ready
        except Unavailable:
            return False

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        model = self.repository.get(name, version)
        versions = [str(m.version) for m in self.repository.versions(name) if m.ready]
        return {
            "name": name,
            "versions": versions,
            "platform": triton_platform(model.config.engine),
            **model.metadata(),
        }

    def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        config = self.repository.get(name, version).config if version else self.repository.config(name)
        return triton_model_config(config)

    def statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        if name is None:
            models = [m for m in self.repository.loaded() if m.ready]
        elif version:
            models = [self.repository.get(name, version)]
        else:
            models = self.repository.versions(name)
            if not models:
                self.repository.get(name)  # raises the reason
        return {"model_stats": [m.stats.as_dict(m.config.name, m.version) for m in models]}

    def repository_index(self, ready_only: bool) -> list[dict[str, str]]:
        entries = [e.as_dict() for e in self.repository.index()]
        return [e for e in entries if e["state"] == "READY"] if ready_only else entries

    async def load(self, name: str, parameters: dict[str, Any]) -> None:
        if parameters.get("config") or any(k.startswith("file:") for k in parameters):
            raise InvalidInput("loading with a config override or files is not supported; edit config.yaml")
        await self.repository.load(name)

    async def unload(self, name: str) -> None:
        await self.repository.unload(name)

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        record: RequestRecord | None = None,
    ) -> tuple[bytes, int | None]:
        """One v2 infer call: bytes in, response bytes (and binary header length) out."""
        if len(body) > OFFLOAD_BYTES:
            decoded = await asyncio.to_thread(decode_request, body, header_length)
        else:
            decoded = decode_request(body, header_length)
        if record is not None:  # before the lookup: a 404 or 503 line names its request too
            record.request_id = decoded.id
        model = self.repository.get(name, version)
        if record is not None:
            record.model_version = model.version
        selection = selected_outputs(model.config, decoded)
        outputs = await model.infer(decoded.inputs, decoded.parameters, record)
        tensors = [(n, datatype, outputs[n], binary) for n, datatype, binary in selection]
        if sum(t[2].nbytes for t in tensors) > OFFLOAD_BYTES:
            return await asyncio.to_thread(encode_response, name, model.version, decoded.id, tensors)
        return encode_response(name, model.version, decoded.id, tensors)


def selected_outputs(config: ModelConfig, request: DecodedRequest) -> list[tuple[str, str, bool]]:
    """(name, datatype, as_binary) of each output to return, checked before any compute."""
    if request.outputs is None:
        return [(t.name, t.datatype, request.binary_output) for t in config.outputs]
    selection = []
    for wanted in request.outputs:
        tensor = config.output(wanted.name)
        if tensor is None:
            names = ", ".join(t.name for t in config.outputs)
            raise InvalidInput(f"model '{config.name}' has no output '{wanted.name}' (outputs: {names})")
        binary = request.binary_output if wanted.binary is None else wanted.binary
        selection.append((tensor.name, tensor.datatype, binary))
    return selection
