"""Writes ``tests/slow_tests.txt``: the test functions that took over ``--seconds`` (setup, call
and teardown together, any one parametrisation) in a ``pytest --durations=0`` log, so that
``pytest -m "not slow"`` stays the quick loop (``tests/conftest.py`` marks them ``slow``).

    python -m pytest tests -q --durations=0 > /tmp/suite.log
    python tools/slow_tests.py /tmp/suite.log            # then review and commit the list
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def slow_functions(log: str, seconds: float) -> list[str]:
    """``module::function`` of every test whose time in ``log`` exceeds ``seconds``."""
    per_test: dict[str, float] = collections.defaultdict(float)
    for line in log.splitlines():
        match = LINE.match(line.strip())
        if match:
            per_test[match.group(3)] += float(match.group(1))
    return sorted({test.split("[")[0] for test, s in per_test.items() if s > seconds})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="output of pytest --durations=0")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "tests" /
                                             "slow_tests.txt"))
    args = parser.parse_args()
    names = slow_functions(Path(args.log).read_text(), args.seconds)
    if not names:
        raise SystemExit(f"{args.log} has no durations (run pytest with --durations=0)")
    Path(args.out).write_text("\n".join(names) + "\n")
    print(f"{len(names)} test functions over {args.seconds} s -> {args.out}")


if __name__ == "__main__":
    main()
