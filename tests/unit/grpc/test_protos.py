"""The committed gRPC modules are what their .proto files compile to, and both are the wire
format of the tritonclient this server is tested with."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from server.grpc.protos import generate, grpc_service_pb2, model_config_pb2


def _committed(module: object) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)  # type: ignore[attr-defined]


def test_the_committed_modules_are_the_proto_files_compiled(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) compiles the .proto files")
    compiled = {f.name: f for f in generate.descriptor_set(tmp_path).file}
    for module in (model_config_pb2, grpc_service_pb2):
        committed = _committed(module)
        assert compiled[committed.name] == committed, (
            f"{committed.name} and its module differ: run `python -m server.grpc.protos.generate`"
        )


def test_the_proto_files_are_tritonclients_wire_format() -> None:
    from tritonclient.grpc import model_config_pb2 as client_config
    from tritonclient.grpc import service_pb2 as client_service

    assert _committed(grpc_service_pb2) == _committed(client_service)
    assert _committed(model_config_pb2) == _committed(client_config)


def test_rendering_a_descriptor_gives_its_proto_text_back() -> None:
    """The renderer that wrote the .proto files writes them again, byte for byte (but for the
    license header, which comes from the installed wheel)."""
    for module, name in ((model_config_pb2, "model_config.proto"), (grpc_service_pb2, "grpc_service.proto")):
        on_disk = (generate.HERE / name).read_text()
        body = on_disk[on_disk.index('syntax = "proto3";'):]
        rendered = generate.render_proto(_committed(module), "", "x")
        assert rendered[rendered.index('syntax = "proto3";'):] == body


def test_the_service_has_every_rpc_tritonclient_calls() -> None:
    methods = {m.name: m for m in grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
                 "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"):
        assert name in methods
    stream = methods["ModelStreamInfer"]
    assert stream.client_streaming and stream.server_streaming


def test_the_type_stubs_declare_every_message_and_enum_of_their_modules() -> None:
    """The .pyi beside each module (written by generate.py with it) types the server's use of
    the messages: one the module has and the stub lacks would go unchecked. Nested messages and
    enums are declared inside their parent's class, one level of indent deeper."""
    for module in (model_config_pb2, grpc_service_pb2):
        stub = Path(str(module.__file__)).with_suffix(".pyi").read_text()
        file = _committed(module)
        expected = [f"\nclass {e.name}(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):" for e in file.enum_type]
        for message in file.message_type:
            expected += _declared(message, "")
        for declaration in expected:
            assert declaration in stub, f"{declaration.strip()} is not in {module.__name__}'s stub"


def _declared(message: descriptor_pb2.DescriptorProto, indent: str) -> list[str]:
    inner = indent + "    "
    lines = [f"\n{indent}class {message.name}(_message.Message):"]
    lines += [f"\n{inner}class {e.name}(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):" for e in message.enum_type]
    for nested in message.nested_type:
        lines += _declared(nested, inner)
    return lines
