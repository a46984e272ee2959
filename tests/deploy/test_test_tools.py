"""scripts/test-tools.sh, which `make test` runs first: it installs wrk, h2load and prometheus when
they are missing, or stops with one line saying why it cannot, before any test runs. Driven here on a
PATH of stand-ins, so each branch runs without touching the machine's packages."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test-tools.sh"


def _stand_ins(folder: Path, uid: int, tools: dict[str, str]) -> Path:
    """A PATH folder holding `id` (answering `uid`) and each tool as a script of the given body."""
    folder.mkdir()
    for name, body in {"id": f"echo {uid}", **tools}.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return folder


def _run(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", str(SCRIPT)], env={"PATH": str(path)}, capture_output=True, text=True,
                          timeout=30, check=False)


def test_nothing_is_done_when_the_tools_are_there(tmp_path: Path) -> None:
    path = _stand_ins(tmp_path / "bin", 1000, {"wrk": "", "promtool": "", "h2load": "",
                                               "apt-get": "echo called > apt.log"})
    done = _run(path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_without_root_it_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    done = _run(_stand_ins(tmp_path / "bin", 1000, {"wrk": "", "apt-get": "exit 0"}))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "prometheus" in done.stderr and "wrk" not in done.stderr
    assert "sudo apt-get install -y prometheus" in done.stderr


def test_without_apt_get_it_says_so_in_one_line(tmp_path: Path) -> None:
    done = _run(_stand_ins(tmp_path / "bin", 0, {}))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "wrk prometheus" in done.stderr and "no apt-get" in done.stderr


def test_as_root_it_installs_what_is_missing_and_checks_it_arrived(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    log = tmp_path / "apt.log"
    # a stand-in apt-get that records its arguments and "installs" stand-ins of the four tools
    install = (f'echo "$@" >> {log}\n'
               f'case "$*" in *install*) for t in wrk promtool prometheus h2load; do '
               f'printf "#!/bin/sh\\n" > {bin_dir}/$t; /bin/chmod +x {bin_dir}/$t; done;; esac')
    done = _run(_stand_ins(bin_dir, 0, {"apt-get": install}))
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "update -qq" and calls[1].startswith("install")
    assert calls[1].endswith("wrk prometheus nghttp2-client")


def test_as_root_a_failed_install_fails(tmp_path: Path) -> None:
    done = _run(_stand_ins(tmp_path / "bin", 0, {"apt-get": "exit 0"}))  # "succeeds", installs nothing
    assert done.returncode == 1 and "still missing" in done.stderr
