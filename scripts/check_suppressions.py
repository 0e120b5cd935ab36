"""Every noqa and type-ignore comment in the repository says why, on the same line.

A suppression without a reason hides a finding for good: the next reader cannot tell a real
exception (an optional dependency imported where used, a deliberate wrong value in a test)
from a silenced bug. Accepted forms, the reason after a dash, colon, ``#`` or parenthesis::

    import torch_xla  # noqa: PLC0415 - optional dependency, imported when used
    x = f(bad)  # type: ignore[arg-type]  # wrong on purpose

Exit status 1 with the offending lines listed; 0 otherwise.
Run: ``.venv/bin/python scripts/check_suppressions.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from check_coverage import ROOT, repository_files

SUPPRESSION = re.compile(r"#\s*(noqa(?::\s*[A-Z0-9, ]+)?|type:\s*ignore(?:\[[^\]]*\])?)(.*)$")
REASON = re.compile(r"^(-|—|#|:|\()\s*\S")


def unexplained(path: Path) -> list[str]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = SUPPRESSION.search(line)
        if m and not REASON.match(m.group(2).strip()):
            out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return out


def main() -> int:
    bad = [hit for p in sorted(repository_files()) for hit in unexplained(p)]
    if bad:
        print(f"{len(bad)} suppression(s) without a reason on the line:", file=sys.stderr)
        print("\n".join(f"  {b}" for b in bad), file=sys.stderr)
        return 1
    print("every noqa / type: ignore carries its reason")
    return 0


if __name__ == "__main__":
    sys.exit(main())
