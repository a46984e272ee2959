"""Regenerate the gRPC modules of this folder from its .proto files (grpcio-tools).

    python -m server.grpc.protos.generate              # .proto -> *_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m server.grpc.protos.generate --from-tritonclient   # rewrite the .proto first

The .proto files are Triton's `grpc_service.proto` and `model_config.proto` (BSD-3), rendered
from the descriptors that the installed tritonclient wheel carries: the wheel ships the compiled
schema but not its text, and a schema rendered from the client's own descriptors is the client's
wire format by construction (tests/unit/grpc/test_protos.py checks that both compile to the
same descriptors). Comments of the original text are not in the descriptors, so not here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

HERE = Path(__file__).resolve().parent
PROTOS = ("model_config.proto", "grpc_service.proto")
PACKAGE = "server.grpc.protos"

_SCALARS = {
    descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE: "double",
    descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT: "float",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT64: "int64",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: "uint64",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT32: "int32",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED64: "fixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED32: "fixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_BOOL: "bool",
    descriptor_pb2.FieldDescriptorProto.TYPE_STRING: "string",
    descriptor_pb2.FieldDescriptorProto.TYPE_BYTES: "bytes",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32: "uint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED32: "sfixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED64: "sfixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT32: "sint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT64: "sint64",
}
_REFERENCES = (descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, descriptor_pb2.FieldDescriptorProto.TYPE_ENUM)


def render_proto(file: descriptor_pb2.FileDescriptorProto, license_text: str, source: str) -> str:
    """The .proto text of a file descriptor: protoc compiles it back to the same descriptor."""
    lines = [*("// " + line if line else "//" for line in license_text.splitlines())]
    lines += ["", f"// Rendered from {source}; see generate.py.", "", f'syntax = "{file.syntax or "proto2"}";', ""]
    lines.append(f"package {file.package};")
    lines += [f'import "{dependency}";' for dependency in file.dependency]
    for enum in file.enum_type:
        lines += ["", *_enum(enum, "")]
    for message in file.message_type:
        lines += ["", *_message(message, "")]
    for service in file.service:
        lines += ["", f"service {service.name} {{"]
        for method in service.method:
            request = ("stream " if method.client_streaming else "") + method.input_type
            reply = ("stream " if method.server_streaming else "") + method.output_type
            lines.append(f"  rpc {method.name}({request}) returns ({reply}) {{}}")
        lines.append("}")
    return "\n".join(lines) + "\n"


def _enum(enum: descriptor_pb2.EnumDescriptorProto, indent: str) -> list[str]:
    return [f"{indent}enum {enum.name} {{", *(f"{indent}  {v.name} = {v.number};" for v in enum.value), f"{indent}}}"]


def _message(message: descriptor_pb2.DescriptorProto, indent: str) -> list[str]:
    """Declarations in the order that gives protoc's order back: a map field declares its entry
    type where it stands, so fields are written up to each map field as its entry comes."""
    inner = indent + "  "
    lines = [f"{indent}message {message.name} {{"]
    for enum in message.enum_type:
        lines += _enum(enum, inner)
    entries = {f".{nested.name}": nested for nested in message.nested_type if nested.options.map_entry}
    fields = list(message.field)
    written_oneofs: set[int] = set()
    position = 0

    def write_fields_through(stop: int) -> None:
        nonlocal position
        while position < stop:
            field = fields[position]
            if field.HasField("oneof_index") and not field.proto3_optional:
                index = field.oneof_index
                if index not in written_oneofs:
                    written_oneofs.add(index)
                    lines.append(f"{inner}oneof {message.oneof_decl[index].name} {{")
                    lines.extend(f"{inner}  {_field(f, {})}" for f in fields if f.HasField("oneof_index")
                                 and f.oneof_index == index)
                    lines.append(f"{inner}}}")
            else:
                lines.append(f"{inner}{_field(field, entries)}")
            position += 1

    for nested in message.nested_type:
        if nested.options.map_entry:
            field_at = next(i for i, f in enumerate(fields) if f.type_name.endswith(f".{message.name}.{nested.name}"))
            write_fields_through(field_at + 1)
        else:
            lines += _message(nested, inner)
    write_fields_through(len(fields))
    lines.append(f"{indent}}}")
    return lines


def _field(field: descriptor_pb2.FieldDescriptorProto, entries: dict[str, descriptor_pb2.DescriptorProto]) -> str:
    entry = next((e for suffix, e in entries.items() if field.type_name.endswith(suffix)), None)
    if entry is not None and field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
        key, value = entry.field
        return f"map<{_type(key)}, {_type(value)}> {field.name} = {field.number};"
    label = ""
    if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
        label = "repeated "
    elif field.proto3_optional:
        label = "optional "
    return f"{label}{_type(field)} {field.name} = {field.number};"


def _type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    return field.type_name if field.type in _REFERENCES else _SCALARS[field.type]


def from_tritonclient() -> None:
    """Write the .proto files from the installed tritonclient's compiled descriptors."""
    from tritonclient.grpc import model_config_pb2, service_pb2

    version = importlib.metadata.version("tritonclient")
    distribution = importlib.metadata.distribution("tritonclient")
    licenses = [f for f in distribution.files or [] if "licenses/" in str(f) or str(f).endswith("LICENSE")]
    license_text = licenses[0].read_text() if licenses else ""
    license_text = "\n".join(line.removeprefix("#").removeprefix(" ") for line in license_text.splitlines())
    for module in (model_config_pb2, service_pb2):
        file = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        text = render_proto(file, license_text.strip(), f"the descriptors of tritonclient {version} (Triton's {file.name})")
        (HERE / file.name).write_text(text)


def compile_protos(out: Path) -> None:
    """*_pb2.py, its type stub *_pb2.pyi, and *_pb2_grpc.py of every .proto here into `out`, importing each other from
    this package (protoc writes top-level imports, as tritonclient's build fixes up too)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as scratch:
        command = ["protoc", f"-I{HERE}", f"--python_out={scratch}", f"--pyi_out={scratch}",
                   f"--grpc_python_out={scratch}", *(str(HERE / name) for name in PROTOS)]
        if protoc.main(command) != 0:
            raise SystemExit("protoc failed")
        for generated in sorted([*Path(scratch).glob("*.py"), *Path(scratch).glob("*.pyi")]):
            if generated.name.endswith("_pb2_grpc.py") and "Stub" not in generated.read_text():
                continue  # a file without a service: protoc writes an empty module
            text = re.sub(r"^import (\w+_pb2) as", rf"from {PACKAGE} import \1 as", generated.read_text(),
                          flags=re.MULTILINE)
            (out / generated.name).write_text("# ruff: noqa\n" + text)


def descriptor_set(out: Path) -> descriptor_pb2.FileDescriptorSet:
    """The descriptors protoc compiles the .proto files here to (what the modules must hold)."""
    from grpc_tools import protoc

    target = out / "descriptors.pb"
    if protoc.main(["protoc", f"-I{HERE}", f"--descriptor_set_out={target}", *(str(HERE / n) for n in PROTOS)]) != 0:
        raise SystemExit("protoc failed")
    files = descriptor_pb2.FileDescriptorSet.FromString(target.read_bytes())
    for file in files.file:  # protoc fills in json_name here; the Python modules leave it out
        for message in file.message_type:
            _clear_json_names(message)
    return files


def _clear_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _clear_json_names(nested)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-tritonclient", action="store_true",
                        help="first rewrite the .proto files from the installed tritonclient")
    args = parser.parse_args(argv)
    if args.from_tritonclient:
        from_tritonclient()
    compile_protos(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
