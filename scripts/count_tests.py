"""Count the tests pytest collects per layer and hold each layer to its floor.

    python scripts/count_tests.py [--raise-floors] [DIR ...]   (default: tests functional_tests)

The layers are ``tests/<layer>/`` (unit, distributed, integration, gpu) and ``functional_tests/``
(functional). The floors are recorded in ``tests/collection_floors.json``; a layer that collects
fewer tests than its floor, a layer that collects none, a collection error or a test file outside
every layer fails the run (exit 1), so that a test run cannot lose a directory or a file
unnoticed. Adding tests means raising the floors: ``--raise-floors`` writes the counts collected
now wherever they are higher (it never lowers one; lowering is an edit of the file, in review).

``scripts/run_tests.sh`` (what CI runs) calls this before the tests themselves.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ROOT / "tests" / "collection_floors.json"
LAYERS = ("unit", "distributed", "integration", "functional", "gpu")
DIRECTORIES = ("tests", "functional_tests")


def layer_of(path: str) -> Optional[str]:
    """The layer of a collected test file's path (relative to the repository), None outside."""
    parts = Path(path).parts
    if parts[:1] == ("functional_tests",):
        return "functional"
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in LAYERS:
        return parts[1]
    return None


def collect(directories: Sequence[str]) -> str:
    """pytest's ``--collect-only -qq`` listing (``path: count`` per file); raises on an error."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-qq", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *directories], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"test collection failed (pytest exit {done.returncode}):\n{done.stdout}{done.stderr}"
        )
    return done.stdout


def count_by_layer(listing: str) -> Dict[str, int]:
    """Tests per layer from a ``-qq`` listing; a file outside every layer is a ValueError."""
    counts = dict.fromkeys(LAYERS, 0)
    for line in listing.splitlines():
        path, sep, number = line.rpartition(": ")
        if not sep or not number.strip().isdigit():
            continue
        layer = layer_of(path)
        if layer is None:
            raise ValueError(f"{path}: a test file outside every layer ({', '.join(LAYERS)})")
        counts[layer] += int(number)
    return counts


def shortfalls(counts: Mapping[str, int], floors: Mapping[str, int]) -> List[str]:
    """Why ``counts`` fall short of ``floors``, one phrase per layer (none: they pass)."""
    found = []
    for layer in LAYERS:
        floor, count = floors.get(layer), counts.get(layer, 0)
        if floor is None:
            found.append(f"{layer}: no floor recorded in {FLOORS.name}")
        elif count == 0 or count < floor:
            found.append(f"{layer}: {count} tests collected, floor {floor}")
    return found


def table(counts: Mapping[str, int], floors: Mapping[str, int]) -> str:
    rows = [f"{'layer':<12} {'tests':>6} {'floor':>6}"]
    for layer in LAYERS:
        rows.append(f"{layer:<12} {counts.get(layer, 0):>6} {floors.get(layer, '-')!s:>6}")
    rows.append(f"{'total':<12} {sum(counts.values()):>6}")
    return "\n".join(rows)


def raised(counts: Mapping[str, int], floors: Mapping[str, int]) -> Dict[str, int]:
    return {layer: max(counts.get(layer, 0), floors.get(layer, 0)) for layer in LAYERS}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="*", default=list(DIRECTORIES))
    parser.add_argument("--raise-floors", action="store_true", help="record higher counts")
    options = parser.parse_args(argv)
    floors = json.loads(FLOORS.read_text())
    try:
        counts = count_by_layer(collect(options.directories))
    except (RuntimeError, ValueError) as error:
        print(f"count_tests: FAIL: {error}", file=sys.stderr)
        return 1
    print(table(counts, floors), flush=True)
    if options.raise_floors:
        floors = raised(counts, floors)
        FLOORS.write_text(json.dumps(floors, indent=2) + "\n")
        print(f"count_tests: floors written to {FLOORS.relative_to(ROOT)}")
    problems = shortfalls(counts, floors)
    if problems:
        print(f"count_tests: FAIL: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print("count_tests: every layer at or above its floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
