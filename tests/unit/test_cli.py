"""The command line: flags over environment, and `bench` handing over to the benchmarks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.cli import build_parser, main
from server.settings import settings_from


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_HTTP_PORT", "9001")
    monkeypatch.setenv("BATCHLINE_MODEL_REPOSITORY", "/srv/models")
    monkeypatch.setenv("BATCHLINE_ACCESS_LOG", "json")
    from_env = settings_from(build_parser().parse_args(["serve"]))
    assert (from_env.http_port, from_env.model_repository, from_env.access_log) == (9001, Path("/srv/models"), "json")
    flags = settings_from(
        build_parser().parse_args(["serve", "--http-port", "9002", "--engine-threads", "1", "--model", "a", "--model", "b"])
    )
    assert (flags.http_port, flags.engine_threads, flags.models) == (9002, 1, ["a", "b"])
    assert flags.model_repository == Path("/srv/models")


def test_serve_refuses_a_missing_repository(tmp_path: Path) -> None:
    assert main(["serve", "--model-repository", str(tmp_path / "nowhere")]) == 2


def test_bench_hands_every_argument_to_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "engine", "--help"])
    assert exited.value.code == 0
    assert "--batch-sizes" in capsys.readouterr().out


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_help_speaks_of_commands_a_user_types(capsys: pytest.CaptureFixture[str]) -> None:
    """Every --help names the command as typed (`batchline ...`), never a module path to run,
    a Python module or the project's issue titles."""
    from loadtest.bench import build_parser as bench_parser

    modes = next(a for a in bench_parser()._actions if a.dest == "mode").choices
    assert modes and "closed" in modes
    commands = [(), ("serve",), ("build",), ("bench",), *(("bench", mode) for mode in modes)]
    for argv in commands:
        text = _help(capsys, *argv)
        assert text.startswith("usage: " + " ".join(("batchline", *argv))), (argv, text[:80])
        internal = re.search(r"python -m|\b(server|loadtest)\.[a-z_]|issue", text)
        assert internal is None, (argv, internal)


def test_bench_without_its_registered_command_says_to_reinstall(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """`batchline bench` is found among the installed entry points: an install whose metadata
    predates it says so, instead of a traceback or a wrong hint."""
    from server import cli

    monkeypatch.setattr(cli, "entry_points", lambda **_: ())
    assert main(["bench", "engine", "--help"]) == 2
    assert "reinstall" in caplog.text
