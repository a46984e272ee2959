"""Print the third-party requirements of pyproject.toml's package, one a line, for pip -r:

    python3 requirements-of.py PYPROJECT [--extras-only] EXTRA...

Its `dependencies` (unless --extras-only) and those of each EXTRA; an extra that names the
package itself (`batchline[a,b]`) is followed. The image installs these in a layer of their own,
before the package's source is copied in, so a change to the code reuses that layer.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str], base: bool = True) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    found: list[str] = list(project.get("dependencies", [])) if base else []
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"requirements-of: {pyproject} has no extra {extra!r}")
        seen.add(extra)
        for requirement in optional[extra]:
            own = re.fullmatch(rf"{re.escape(name)}\s*\[([^\]]*)\]\s*", requirement)
            if own:
                pending.extend(e.strip() for e in own.group(1).split(","))
            elif requirement not in found:
                found.append(requirement)
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: requirements-of.py PYPROJECT [--extras-only] EXTRA...", file=sys.stderr)
        return 2
    pyproject, *rest = argv
    base = "--extras-only" not in rest
    extras = [a for a in rest if a != "--extras-only"]
    print("\n".join(requirements(Path(pyproject), extras, base)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
