"""The model repository: discovers models on disk, loads and unloads them, answers readiness.

`<root>/<name>/config.yaml` plus numeric version folders; the config's version_policy picks
which versions serve. Loading one model never blocks or breaks another.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from server.config import ModelConfig, load_model_config
from server.engines.registry import ENGINES
from server.errors import BatchlineError, ConfigError, EngineError, InvalidInput, ModelNotFound, Unavailable
from server.layout import CONFIG_FILENAME, config_path, found_version_dir, version_number, version_numbers
from server.load_gate import LOADS, run_load
from server.model import ModelState, ModelVersion
from server.quantize.ensure import ensure_built

logger = logging.getLogger(__name__)


@dataclass
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        entry = {"name": self.name, "state": self.state, "reason": self.reason}
        if self.version:
            entry["version"] = self.version
        return entry


class ModelRepository:
    def __init__(self, root: Path, engine_threads: int | None = None) -> None:
        self.root = root
        self._engine_threads = engine_threads
        self._versions: dict[str, dict[int, ModelVersion]] = {}
        self._failures: dict[str, str] = {}  # model name -> why it could not be loaded at all
        self._unloaded: set[str] = set()  # explicitly unloaded, shown as such in the index
        self._locks: dict[str, asyncio.Lock] = {}
        self._changing: set[asyncio.Task[None]] = set()  # loads and unloads whose callers may have left
        self._not_names: set[str] = set()  # folders left out for a name that is not UTF-8, said in the log
        self._loading: set[str] = set()  # models loading with no version serving: LOADING in the index
        self.changes = 0  # loads and unloads that built or dropped something: the heap has garbage to free

    def names_on_disk(self) -> list[str]:
        """The model folders; one whose name is not UTF-8 is left out (said once in the log):
        no client could name it, and every protocol's index, and /metrics, would fail on it."""
        if not self.root.is_dir():
            return []
        names = []
        for path in self.root.iterdir():
            if not config_path(path).is_file():
                continue
            try:
                path.name.encode("utf-8")
            except UnicodeEncodeError:
                if path.name not in self._not_names:
                    self._not_names.add(path.name)
                    logger.warning("the folder %r in the model repository is left out: its name is not UTF-8",
                                   path.name.encode("utf-8", "surrogateescape"))
                continue
            names.append(path.name)
        return sorted(names)

    def _model_dir(self, name: str) -> Path:
        """The model's folder; any name that cannot be one (a path, too long for the file system,
        not encodable) is a model the repository does not have, never an OSError."""
        if not _is_folder_name(name):
            raise ModelNotFound(unknown_model(name))
        path = self.root / name
        try:
            found = config_path(path).is_file()
        except (OSError, ValueError):  # ENAMETOOLONG, an embedded NUL, a name not encodable
            found = False
        if not found:
            raise ModelNotFound(unknown_model(name))
        return path

    async def load_all(self, names: list[str] | None = None) -> None:
        """Load the named models (default: all on disk) concurrently; failures are recorded."""
        chosen = names if names is not None else self.names_on_disk()
        results = await asyncio.gather(*(self.load(n) for n in chosen), return_exceptions=True)
        for name, result in zip(chosen, results):
            if isinstance(result, ModelNotFound):  # asked for, not there: the server is not ready
                self._failures[name] = result.message
            if isinstance(result, Exception):  # (some of its versions may serve: the message says)
                logger.error("model %s: %s", name, result)

    async def load(self, name: str, config_override: str | None = None) -> None:
        """(Re)load a model. The new versions load and warm up while the old ones serve; they
        take over only when every one of them is ready, then the old ones drain. A reload that
        fails (config, build, artifact, warm-up, memory) leaves the old versions serving and
        raises the reason, as Triton does. `config_override` (JSON) stands in for config.yaml
        for this load only, as Triton's `config` load parameter: config.yaml is not touched.
        A caller that stops waiting (a client's deadline) does not stop it (`_to_the_end`)."""
        path = self._model_dir(name)
        await self._to_the_end(self._load(name, path, config_override))

    async def _to_the_end(self, change: Coroutine[Any, Any, None]) -> None:
        """Run a load or unload to its end whatever becomes of the caller: one cut short would
        leave versions built and never closed, or an old version half drained, its computing
        requests failed and its engines never freed."""
        task = asyncio.ensure_future(change)
        self._changing.add(task)
        task.add_done_callback(self._changing.discard)
        await asyncio.shield(task)  # a caller cancelled here leaves it running (shield reads its outcome)

    async def _load(self, name: str, path: Path, config_override: str | None) -> None:
        async with self._locks.setdefault(name, asyncio.Lock()):
            self._loading.add(name)
            try:
                await self._load_locked(name, path, config_override)
            finally:
                self._loading.discard(name)

    async def _load_locked(self, name: str, path: Path, config_override: str | None) -> None:
        old = self._versions.get(name, {})
        serving = sorted(v for v, m in old.items() if m.ready)
        try:
            if config_override is None:
                config = self._with_overrides(load_model_config(config_path(path)))
            else:
                config = self._with_overrides(override_config(path, config_override))
            if config.build is not None:  # a variant built from another model: build or reuse
                self.changes += 1
                await run_load(_built, self.root, name, config)
                # the build publishes the config it serves under (a torch INT8 program takes FP32)
                config = self._with_overrides(load_model_config(config_path(path)))
            selected = config.version_policy.select(version_numbers(path))
            if not selected:
                raise ConfigError(f"{path}: no version folder (e.g. {path}/1) to serve")
        except ConfigError as exc:
            raise self._failed(name, exc.message, serving, InvalidInput) from exc
        except EngineError as exc:
            raise self._failed(name, exc.message, serving, Unavailable) from exc
        fresh = {v: ModelVersion(config, v, found_version_dir(path, v)) for v in selected}
        self.changes += 1
        await asyncio.gather(*(m.load() for m in fresh.values()))
        failed = [m for m in fresh.values() if not m.ready]
        # a config that misdescribes its model is the caller's to fix (400); anything else, 503
        refusal = InvalidInput if failed and all(m.config_mismatch for m in failed) else Unavailable
        if failed and serving:  # swap only a wholly ready set; the old one serves on
            await asyncio.gather(*(m.unload() for m in fresh.values() if m.ready))
            raise self._failed(name, _reasons(failed), serving, refusal)
        self._failures.pop(name, None)
        self._unloaded.discard(name)
        replaced = {v: (m, old[v], old[v].stats.totals()) for v, m in fresh.items() if v in old}
        for new, previous, _ in replaced.values():
            new.stats.carry_totals(previous.stats)  # one series under the same labels, not a reset
        self._versions[name] = fresh
        await asyncio.gather(*(m.unload() for m in old.values()))
        for new, previous, at_swap in replaced.values():  # what the old one answered as it drained
            new.stats.carry_totals(previous.stats, since=at_swap)
        if failed and len(failed) == len(fresh):
            raise refusal(f"failed to load '{name}': {failed[0].reason}")
        if failed:  # nothing served before: what loaded serves, and the caller is told what did not
            served = [v for v, m in sorted(fresh.items()) if m.ready]
            raise refusal(f"failed to load '{name}': {_reasons(failed)} ({_serve(served)})")

    def _failed(self, name: str, reason: str, serving: list[int], error: type[BatchlineError]) -> BatchlineError:
        """The error a failed (re)load answers; with nothing serving, the model shows it too."""
        if not serving:
            self._failures[name] = reason
            logger.error("model %s: %s", name, reason)
            return error(f"failed to load '{name}': {reason}")
        kept = _serve(serving)
        logger.error("model %s was not reloaded, %s on: %s", name, kept, reason)
        return error(f"failed to load '{name}': {reason} ({kept} on)")

    def _with_overrides(self, config: ModelConfig) -> ModelConfig:
        """Apply server-wide settings that win over each model's own (engine threads)."""
        if self._engine_threads is None:
            return config
        return ENGINES[config.engine].with_threads(config, self._engine_threads)

    async def unload(self, name: str) -> None:
        """Drain and free every version of a model, to the end whatever becomes of the caller.
        A model loaded or asked for unloads even once its folder is gone from the repository:
        else it would serve, or hold the server unready, until a restart."""
        if name not in self._versions and name not in self._failures:
            self._model_dir(name)  # ModelNotFound
        await self._to_the_end(self._unload(name))

    async def _unload(self, name: str) -> None:
        async with self._locks.setdefault(name, asyncio.Lock()):
            versions = self._versions.pop(name, {})
            self._failures.pop(name, None)
            self.changes += bool(versions)
            await asyncio.gather(*(m.unload() for m in versions.values()))
            self._unloaded.add(name)

    async def unload_all(self) -> None:
        """Unload every model, once the loads in progress (at startup, or a client's) have ended:
        they run to their end whoever stopped waiting for them, and are unloaded then too."""
        while self._changing:
            await asyncio.wait(list(self._changing))
        await asyncio.gather(*(self.unload(n) for n in list(self._versions)))

    def get(self, name: str, version: str | None = None) -> ModelVersion:
        """The version to serve: the one named, or the highest ready one."""
        versions = self._versions.get(name)
        if versions is None:
            self._model_dir(name)  # ModelNotFound when not on disk at all
            raise Unavailable(f"model '{name}' is not loaded")
        if version:
            number = version_number(version)
            if number is None or number not in versions:
                raise ModelNotFound(unknown_model(name, version))
            chosen = versions[number]
            if not chosen.ready:
                raise Unavailable(f"model '{name}' version {version} is not ready: {chosen.reason}")
            return chosen
        newest = -1  # a loop, not a list and max(): every call asks
        for number, model in versions.items():
            if number > newest and model.ready:
                newest = number
        if newest < 0:
            reasons = "; ".join(m.reason for m in versions.values() if m.reason)
            raise Unavailable(f"model '{name}' is not ready" + (f": {reasons}" if reasons else ""))
        return versions[newest]

    def versions(self, name: str) -> list[ModelVersion]:
        return [m for _, m in sorted(self._versions.get(name, {}).items())]

    def config(self, name: str) -> ModelConfig:
        """The served config, or the one on disk when the model is not loaded."""
        loaded = self.versions(name)
        if loaded:
            return loaded[-1].config
        return load_model_config(config_path(self._model_dir(name)))

    def loaded(self) -> list[ModelVersion]:
        return [m for name in sorted(self._versions) for m in self.versions(name)]

    def live(self) -> bool:
        """False once a model lost every instance to threads stuck in its engine: a thread cannot
        be killed, so only a new process frees them (liveness asks the orchestrator for one)."""
        return not any(m.wedged for m in self.loaded())

    def all_ready(self) -> bool:
        """Strict readiness, as Triton: every model asked for is loaded and ready."""
        if self._failures:
            return False
        return all(any(m.ready for m in vs.values()) for vs in self._versions.values())

    def index(self) -> list[IndexEntry]:
        """Every model on disk, and every model loaded or asked for that is not."""
        entries = []
        for name in sorted({*self.names_on_disk(), *self._versions, *self._failures}):
            if name in self._loading and name not in self._versions:  # a reload shows the versions serving
                entries.append(IndexEntry(name, "", "LOADING", ""))
            elif name in self._failures:
                entries.append(IndexEntry(name, "", "UNAVAILABLE", self._failures[name]))
            elif name in self._versions:
                entries.extend(
                    IndexEntry(name, str(m.version), m.state.value, m.reason)
                    for m in self.versions(name)
                )
            else:
                unloaded = name in self._unloaded
                entries.append(IndexEntry(name, "", "UNAVAILABLE" if unloaded else "", "unloaded" if unloaded else ""))
        return entries


def _built(root: Path, name: str, config: ModelConfig) -> None:
    """A variant's artifact built (or reused) at load, counted as a load: no batch profile of
    another model times beside it."""
    with LOADS.building(f"the build of {name}"):
        ensure_built(root, name, config)


def override_config(folder: Path, text: str) -> ModelConfig:
    """A config sent with a load: JSON in config.yaml's schema, validated as config.yaml is. A
    build is declared in config.yaml only (a build publishes the config it serves under)."""
    where = f"the config sent to load '{folder.name}'"
    try:
        raw = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object at the top level")
    raw.setdefault("name", folder.name)
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as exc:
        reasons = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '(top level)'}': {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"{where}: {reasons}") from exc
    if config.name != folder.name:
        raise ConfigError(f"{where}: field 'name': {config.name!r} differs from the model's {folder.name!r}")
    if config.build is not None:
        raise ConfigError(f"{where}: field 'build': a build is declared in {CONFIG_FILENAME}, not sent with a load")
    return config


def unknown_model(name: str, version: str | None = None) -> str:
    """Triton's words for a model or version it does not have, which clients written for
    Triton match on. A name no folder can have is cut short: /v1's `model` of 5 MB came back
    whole in its 404."""
    if len(name) > _MAX_NAME_BYTES:
        name = name[:_MAX_NAME_BYTES] + "..."
    if version is not None and len(version) > _MAX_NAME_BYTES:
        version = version[:_MAX_NAME_BYTES] + "..."
    return f"Request for unknown model: '{name}'" + (f" version {version}" if version else "") + " is not found"


# A model name is one folder name: at most NAME_MAX (255) bytes on the file systems we serve from.
_MAX_NAME_BYTES = 255


def _reasons(failed: list[ModelVersion]) -> str:
    return "; ".join(f"version {m.version}: {m.reason}" for m in failed)


def _serve(versions: list[int]) -> str:
    """"version 1 serves", or "versions 1, 3 serve"."""
    if len(versions) == 1:
        return f"version {versions[0]} serves"
    return f"versions {', '.join(map(str, versions))} serve"


def _is_folder_name(name: str) -> bool:
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        return False
    try:
        return len(name.encode("utf-8")) <= _MAX_NAME_BYTES
    except UnicodeEncodeError:  # a lone surrogate: a folder whose name is not UTF-8 (names_on_disk), or none
        return False


__all__ = ["IndexEntry", "ModelRepository", "ModelState", "unknown_model"]
