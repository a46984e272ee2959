"""Server settings: one declaration gives every flag of `batchline serve` and every BATCHLINE_*
variable, with the same type and default, flags over the environment."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from server.cli import build_parser, main
from server.settings import (
    RepositorySettings,
    ServerSettings,
    add_setting_flags,
    env_variable,
    flag_name,
    flag_of,
    settings_from,
)

# A value for each field, as a flag's text and as the setting it must become.
SAMPLES: dict[str, tuple[list[str], Any]] = {
    "model_repository": (["/srv/models"], Path("/srv/models")),
    "host": (["0.0.0.0"], "0.0.0.0"),
    "http_port": (["9002"], 9002),
    "port_file": (["/tmp/port"], Path("/tmp/port")),
    "http_workers": (["4"], 4),
    "allow_grpc": (["false"], False),
    "grpc_port": (["9003"], 9003),
    "grpc_port_file": (["/tmp/grpc-port"], Path("/tmp/grpc-port")),
    "log_level": (["debug"], "debug"),
    "models": (["a", "b"], ["a", "b"]),
    "engine_threads": (["1"], 1),
    "access_log": (["json"], "json"),
    "device_price_per_hour": (["3.5"], 3.5),
    "max_body_bytes": (["1024"], 1024),
    "max_output_bytes": (["2048"], 2048),
    "max_in_flight": (["8"], 8),
    "max_in_flight_bytes": (["4096"], 4096),
    "allow_client_shm": ([], True),
    "model_control": ([], True),
    "admin_token_file": (["/run/admin"], Path("/run/admin")),
    "inference_token_file": (["/run/inference"], Path("/run/inference")),
}
SECRETS = ("admin_token", "inference_token")


@pytest.fixture(autouse=True)
def _no_batchline_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ServerSettings.model_fields:
        monkeypatch.delenv(env_variable(name), raising=False)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    return parser.parse_args(list(argv))


def test_every_setting_is_sampled_here() -> None:
    """A new setting must be added to SAMPLES, so that its flag is tested too."""
    assert set(ServerSettings.model_fields) == set(SAMPLES) | set(SECRETS)


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_each_flag_sets_its_setting(field: str) -> None:
    texts, expected = SAMPLES[field]
    option = flag_name(field, ServerSettings.model_fields[field])
    argv = [option] if not texts else [part for text in texts for part in (option, text)]
    assert getattr(settings_from(_parse(*argv)), field) == expected


@pytest.mark.parametrize("field", sorted(f for f in SAMPLES if f != "models"))
def test_each_variable_sets_its_setting_as_its_flag_does(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    texts, expected = SAMPLES[field]
    monkeypatch.setenv(env_variable(field), texts[0] if texts else "true")
    assert getattr(ServerSettings(), field) == expected
    assert getattr(settings_from(_parse()), field) == expected  # no flag: the variable stands


def test_a_list_setting_is_a_json_list_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_MODELS", '["a", "b"]')
    assert ServerSettings().models == ["a", "b"]


def test_flags_not_given_leave_the_defaults() -> None:
    assert settings_from(_parse()) == ServerSettings()
    defaults = ServerSettings()
    assert (defaults.http_port, defaults.model_repository, defaults.host) == (8000, Path("models"), "127.0.0.1")
    assert defaults.allow_grpc is True and defaults.model_control is False


def test_a_flag_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_HTTP_PORT", "9001")
    monkeypatch.setenv("BATCHLINE_ALLOW_GRPC", "false")
    chosen = settings_from(_parse("--http-port", "9002", "--allow-grpc", "true"))
    assert (chosen.http_port, chosen.allow_grpc) == (9002, True)


def test_a_bad_value_is_refused_by_the_same_rule_from_a_flag_or_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="65535"):
        settings_from(_parse("--http-port", "70000"))
    monkeypatch.setenv("BATCHLINE_HTTP_PORT", "70000")
    with pytest.raises(ValueError, match="65535"):
        ServerSettings()


def test_serve_refuses_a_bad_value_by_its_flag_and_variable_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("BATCHLINE_MAX_IN_FLIGHT", "0")
    assert main(["serve", "--engine-threads", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchline serve: --engine-threads (BATCHLINE_ENGINE_THREADS): ") and "256" in err
    assert "--max-in-flight (BATCHLINE_MAX_IN_FLIGHT): Input should be greater than 0" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("field", SECRETS)
def test_a_secret_is_never_a_flag(field: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert flag_of(ServerSettings.model_fields[field]).secret
    option = flag_name(field, ServerSettings.model_fields[field])
    with pytest.raises(SystemExit):
        _parse(option, "0123456789abcdef0123")
    said = capsys.readouterr().err
    assert f"{option}-file FILE or {env_variable(field)}" in said


def test_serve_help_shows_each_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for field, info in ServerSettings.model_fields.items():
        if field in SECRETS:
            assert flag_name(field, info) + " " not in text
            continue
        assert flag_name(field, info) in text, field
    for shown in ("(default: 8000; env: BATCHLINE_HTTP_PORT)", "(default: models; env: BATCHLINE_MODEL_REPOSITORY)",
                  "(default: true; env: BATCHLINE_ALLOW_GRPC)", "(default: 64 MiB; env: BATCHLINE_MAX_BODY_BYTES)",
                  "(env: BATCHLINE_MODEL_CONTROL)"):
        assert shown in text


def test_the_configuration_guide_and_the_readme_name_every_setting() -> None:
    root = Path(__file__).parents[2]
    guide = (root / "docs" / "configuration.md").read_text(encoding="utf-8")
    readme = (root / "README.md").read_text(encoding="utf-8")
    missing = [name for name in ServerSettings.model_fields if f"`{name.upper()}`" not in guide
               and f"`{env_variable(name)}`" not in guide]
    assert not missing
    assert not [name for name in ServerSettings.model_fields if f"`{env_variable(name)}`" not in readme]
    flags = [flag_name(n, i) for n, i in ServerSettings.model_fields.items() if not flag_of(i).secret]
    assert not [flag for flag in flags if f"`{flag}" not in readme]


@pytest.mark.parametrize("command", ["build", "import"])
def test_every_command_on_a_repository_takes_it_as_serve_does(command: str, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`build` and `import` read the repository from the same declaration as `serve`: same
    flag, same variable, same default."""
    assert set(RepositorySettings.model_fields) <= set(ServerSettings.model_fields)
    base = [command, "m", *(["--engine", "onnxruntime", "--precision", "int8"] if command == "build" else ["--name", "m"])]
    args = build_parser().parse_args(base)
    assert settings_from(args, RepositorySettings).model_repository == Path("models")
    monkeypatch.setenv("BATCHLINE_MODEL_REPOSITORY", "/srv/models")
    assert settings_from(args, RepositorySettings).model_repository == Path("/srv/models")
    flagged = build_parser().parse_args([*base, "--model-repository", "/opt/models"])
    assert settings_from(flagged, RepositorySettings).model_repository == Path("/opt/models")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    assert "env: BATCHLINE_MODEL_REPOSITORY" in " ".join(capsys.readouterr().out.split())
