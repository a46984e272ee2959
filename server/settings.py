"""Server settings, declared once: each field is a `batchline serve` flag and a `BATCHLINE_<FIELD>`
environment variable, with one type, one default and one help text.

The flags are made from the fields (`add_setting_flags`), so a new setting cannot be given a flag
that disagrees with its variable, or a variable that no flag can set. Flags win over the
environment (`settings_from`).
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, overload

from pydantic import Field, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.config import MAX_ENGINE_THREADS

ENV_PREFIX = "BATCHLINE_"
MAX_OUTPUT_BYTES = 64 << 20  # an infer answer's tensors, together
Settings = TypeVar("Settings", bound=BaseSettings)


@dataclass(frozen=True)
class Flag:
    """How a setting reads on the command line, where its field alone does not say it.

    `name`: the flag, when not the field's name in kebab case; `metavar`: the placeholder in
    `--help` (`BYTES` shows the default in MiB or GiB); `secret`: the value must never be a
    flag (argv shows in `ps`): the flag is refused with the way to give it instead."""

    name: str | None = None
    metavar: str | None = None
    secret: bool = False


class RepositorySettings(BaseSettings):
    """What every command that reads a model repository takes (`serve`, `build`, `import`):
    the same flag and the same variable everywhere."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    model_repository: Annotated[Path, Flag(metavar="FOLDER")] = Field(
        default=Path("models"), description="folder of models")


class ServerSettings(RepositorySettings):
    """Process-wide settings of `batchline serve`; every field is also read from `BATCHLINE_<FIELD>`."""

    host: str = Field(default="127.0.0.1", description="address to listen on")
    http_port: Annotated[int, Flag(metavar="PORT")] = Field(
        default=8000, ge=0, le=65535, description="HTTP port (0: any free port, see --port-file)")
    port_file: Annotated[Path | None, Flag(metavar="FILE")] = Field(
        default=None,
        description="once the HTTP socket is bound, write its port number to FILE (replaced whole, never half "
        "written): how a caller learns the port of --http-port 0; poll /v2/health/live before sending")
    http_workers: Annotated[int, Flag(metavar="N")] = Field(
        default=1, ge=1, le=64,
        description="HTTP front-end processes sharing --http-port (1: HTTP is served by the server process "
        "itself). Past 1, N processes parse and encode HTTP on their own cores while batches still form across "
        "all of them in the server process, which keeps the models; gRPC stays in the server process")
    allow_grpc: bool = Field(
        default=True, description="serve gRPC beside HTTP, as Triton's --allow-grpc (false: HTTP only)")
    grpc_port: Annotated[int, Flag(metavar="PORT")] = Field(
        default=8001, ge=0, le=65535, description="gRPC port (0: any free port, see --grpc-port-file)")
    grpc_port_file: Annotated[Path | None, Flag(metavar="FILE")] = Field(
        default=None, description="once gRPC takes calls, write its port number to FILE (as --port-file does for HTTP)")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="how much the server logs")
    models: Annotated[list[str] | None, Flag(name="--model", metavar="NAME")] = Field(
        default=None,
        description="load only this model at start (repeatable; as a variable, a JSON list; default: every model)")
    engine_threads: Annotated[int | None, Flag(metavar="N")] = Field(
        default=None, gt=0, le=MAX_ENGINE_THREADS,
        description=f"threads per engine instance for every model, overriding the configs (e.g. 1 when pinned to "
        f"one core; at most {MAX_ENGINE_THREADS})")
    access_log: Literal["off", "text", "json"] = Field(
        default="off", description="a line per infer request with id, model, status, queue and compute times")
    device_price_per_hour: Annotated[float | None, Flag(metavar="USD")] = Field(
        default=None, ge=0,
        description="price of this replica's device per hour, exported as batchline_device_price_per_hour")
    max_body_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(
        default=64 << 20, gt=0,
        description="largest infer request body accepted (413 past it), and the most one input may take from a "
        "client's shared-memory region (400 past it)")
    max_output_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(
        default=MAX_OUTPUT_BYTES, gt=0,
        description="most bytes the tensors of one infer answer may hold together, before encoding (400 past it): "
        "a model whose outputs grow with its inputs cannot hold every other client while it encodes gigabytes")
    max_in_flight: Annotated[int, Flag(metavar="N")] = Field(
        default=512, gt=0,
        description="infer requests served at once, over every front end together (with --http-workers N, each HTTP "
        "front end takes 1/N of it); past it 429 + Retry-After before the body is read")
    max_in_flight_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(
        default=1 << 30, gt=0,
        description="bytes of infer bodies held at once (a body with a declared length holds up to 64 KiB of it "
        "from its head on, then what has arrived; one without, what has arrived; a compressed one --max-body-bytes "
        "more while it inflates), over every front end together (with "
        "--http-workers N, each HTTP front end takes 1/N of it); past it 429 + Retry-After, before the body is read "
        "where its declared Content-Length finds no room, else by the part that finds none; request memory stays "
        "near 3x this. Inputs copied from clients' shared memory (--allow-client-shm) have a bound of this size "
        "of their own")
    allow_client_shm: bool = Field(
        default=False,
        description="let clients register system shared-memory regions and pass tensors through them (Triton's "
        "--allow-client-shm): same-host clients then skip copying tensors through HTTP or gRPC, and any client "
        "that may infer can make the server read and write the shared-memory objects (/dev/shm) it can open: "
        "allow only trusted clients")
    model_control: bool = Field(
        default=False,
        description="allow POST /v2/repository/models/NAME/load and /unload (Triton's --model-control-mode=explicit); "
        "needs an admin token unless --host is loopback (off: both answer 403)")
    admin_token: Annotated[SecretStr | None, Flag(secret=True)] = Field(
        default=None, description="the bearer token load/unload need")
    admin_token_file: Annotated[Path | None, Flag(metavar="FILE")] = Field(
        default=None,
        description="the bearer token load/unload need, read from FILE (or BATCHLINE_ADMIN_TOKEN; never a flag: "
        "argv shows in ps)")
    inference_token: Annotated[SecretStr | None, Flag(secret=True)] = Field(
        default=None, description="the bearer token every route but health, /metrics and the docs needs")
    inference_token_file: Annotated[Path | None, Flag(metavar="FILE")] = Field(
        default=None,
        description="the bearer token every route but health, /metrics and the docs needs, read from FILE "
        "(or BATCHLINE_INFERENCE_TOKEN; default: none, those routes are open)")


def env_variable(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def flag_of(info: FieldInfo) -> Flag:
    """The field's Flag, or the plain one its name and type imply."""
    return next((m for m in info.metadata if isinstance(m, Flag)), Flag())


def flag_name(name: str, info: FieldInfo) -> str:
    return flag_of(info).name or "--" + name.replace("_", "-")


def add_setting_flags(parser: argparse.ArgumentParser, settings: type[BaseSettings] = ServerSettings) -> None:
    """One flag per field of `settings`, typed, with its choices, default and help.

    Every flag defaults to None (unset), so that `settings_from` can tell a flag given from one
    left to the environment. Booleans that default to false are switches (`--model-control`);
    those that default to true take `true`/`false`, as Triton's `--allow-grpc=false`."""
    for name, info in settings.model_fields.items():
        flag = flag_of(info)
        option = flag_name(name, info)
        if flag.secret:
            parser.add_argument(option, action=_RefuseSecret, help=argparse.SUPPRESS)
            continue
        help_text = info.description or ""
        kind = _plain_type(info.annotation)
        arguments: dict[str, Any] = {"dest": name, "default": None}
        if kind is bool and info.default is False:
            arguments["action"] = "store_true"
        elif kind is bool:
            arguments["choices"] = ["true", "false"]
        elif get_origin(kind) is Literal:
            arguments["choices"] = list(get_args(kind))
        elif get_origin(kind) is list:
            arguments["action"] = "append"
        else:
            arguments["type"] = kind
        if flag.metavar and "choices" not in arguments:
            arguments["metavar"] = flag.metavar
        shown = _shown_default(info.default, flag.metavar == "BYTES")
        notes = [] if shown is None or (kind is bool and info.default is False) else [f"default: {shown}"]
        notes.append(f"env: {env_variable(name)}")  # as TEI's and clap's help show it
        parser.add_argument(option, help=f"{help_text} ({'; '.join(notes)})", **arguments)


@overload
def settings_from(args: argparse.Namespace) -> ServerSettings: ...
@overload
def settings_from(args: argparse.Namespace, settings: type[Settings]) -> Settings: ...
def settings_from(args: argparse.Namespace, settings: type[BaseSettings] = ServerSettings) -> BaseSettings:
    """The environment (BATCHLINE_*) first, the flags given over it; InvalidSettings names
    each flag (and its variable) whose value is refused."""
    given = {name: getattr(args, name) for name in settings.model_fields if getattr(args, name, None) is not None}
    try:
        return settings(**given)
    except ValidationError as exc:
        fields = settings.model_fields
        lines = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else ""
            where = f"{flag_name(name, fields[name])} ({env_variable(name)})" if name in fields else name
            lines.append(f"{where}: {error['msg']}")
        raise InvalidSettings("; ".join(lines)) from None


class InvalidSettings(ValueError):
    """A setting's value, from its flag or its variable, is refused: the message says which."""


def _plain_type(annotation: Any) -> Any:
    """`int | None` -> int; `Annotated[...]` is already unwrapped by pydantic."""
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return annotation


def _shown_default(default: Any, in_bytes: bool = False) -> str | None:
    if default is None:
        return None
    if isinstance(default, bool):
        return str(default).lower()
    if in_bytes and isinstance(default, int):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if default >= size and default % size == 0:
                return f"{default // size} {unit}"
    return str(default)


class _RefuseSecret(argparse.Action):
    """A secret on the command line shows in `ps` to every user of the machine: refused by name,
    rather than taken by argparse as an abbreviation of its `-file` flag."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        variable = env_variable(self.dest)
        parser.error(f"{option_string} takes no token (the command line shows in ps): use {option_string}-file "
                     f"FILE or {variable}")
