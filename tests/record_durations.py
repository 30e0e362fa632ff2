"""Write tests/durations.json, the seconds each test took (setup + call + teardown), from the output of
`python -m pytest -n auto --maxprocesses 8 --dist loadfile --durations=0 > LOG`; conftest.py orders the files
by it so the xdist workers end together. Run: `python tests/record_durations.py LOG`."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path


def main(log: str) -> None:
    try:
        text = Path(log).read_text()
    except OSError as e:
        raise SystemExit(f"record_durations.py: error: {log}: {e.strerror or e}") from None
    seconds: dict[str, float] = {}
    for m in re.finditer(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$", text, re.M):
        seconds[m.group(2)] = round(seconds.get(m.group(2), 0.0) + float(m.group(1)), 2)
    out = Path(__file__).with_name("durations.json")
    if not seconds:
        raise SystemExit(f"record_durations.py: error: {log} holds no --durations=0 lines; the order is unchanged")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    os.replace(tmp, out)
    print(f"{len(seconds)} tests, {sum(seconds.values()):.0f} s -> {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/record_durations.py LOG")
    main(sys.argv[1])
