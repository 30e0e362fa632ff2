"""Write tests/durations.json, the seconds each test took (setup + call + teardown), from the output of
`python -m pytest -n auto --maxprocesses 8 --dist loadfile --durations=0 > LOG`; conftest.py orders the files
by it so the xdist workers end together. Run: `python tests/record_durations.py LOG`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main(log: str) -> None:
    seconds: dict[str, float] = {}
    for m in re.finditer(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$", Path(log).read_text(), re.M):
        seconds[m.group(2)] = round(seconds.get(m.group(2), 0.0) + float(m.group(1)), 2)
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"{len(seconds)} tests, {sum(seconds.values()):.0f} s -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
