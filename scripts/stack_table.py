"""Each release of kvcalib's tested ranges, tested: installs every given transformers (then compressed-tensors)
release in turn into one environment (`--python`, e.g. ./.venv-newest; without its dependencies, the rest of the
environment as it is) and runs the given test files there; prints scripts/BENCHMARKS.md's table. The environment
is left with the last release of each list installed.

    python scripts/stack_table.py --python .venv-newest/bin/python --transformers 5.18.0 5.19.0 \\
        --compressed-tensors 0.17.0 -- tests/hf/test_families.py tests/hf/test_internals.py
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time

from provenance import REPO, provenance  # this folder is on sys.path when run as a script


def _tested(python: str, package: str, version: str, tests: list[str]) -> str:
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", f"{package}=={version}"],
        check=True,
        capture_output=True,
    )
    started = time.perf_counter()
    done = subprocess.run(
        [python, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]
        + ["-W", "error::FutureWarning", *tests],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    counts = re.findall(r"(\d+) (passed|failed|skipped|error)", done.stdout[-300:])
    summary = ", ".join(f"{n} {what}" for n, what in counts) or done.stdout[-200:]
    return f"| {package} {version} | {summary} | {time.perf_counter() - started:.0f} s |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", required=True)
    parser.add_argument("--transformers", nargs="*", default=[])
    parser.add_argument("--compressed-tensors", nargs="*", default=[])
    parser.add_argument("tests", nargs="+")
    args = parser.parse_args()
    print(provenance(), flush=True)
    print(
        f"\ntests: {' '.join(args.tests)}\n\n| release | tests | time |\n|---|---|---|", flush=True
    )
    for package, versions in (
        ("transformers", args.transformers),
        ("compressed-tensors", args.compressed_tensors),
    ):
        for version in versions:
            print(_tested(args.python, package, version, args.tests), flush=True)


if __name__ == "__main__":
    main()
