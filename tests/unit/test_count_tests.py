"""The collection count that opens every test run (``scripts/count_tests.py``): files map to
their layers, a lost layer or file falls below its floor, a file outside every layer and a
collection error fail, and the recorded floors are met by the collection of this checkout."""

import json

import pytest
from script_loader import load_script

counter = load_script("count_tests")
LISTING = """tests/unit/test_a.py: 3
tests/unit/scheduling/test_b.py: 4
tests/distributed/test_c.py: 2
tests/integration/test_d.py: 5
tests/gpu/test_e.py: 1
functional_tests/test_f.py: 6

7 warnings
"""
FULL = {"unit": 7, "distributed": 2, "integration": 5, "functional": 6, "gpu": 1}


def test_every_file_counts_in_its_layer():
    assert counter.count_by_layer(LISTING) == FULL


def test_a_file_outside_every_layer_is_refused():
    with pytest.raises(ValueError, match="tests/test_stray.py"):
        counter.count_by_layer(LISTING + "tests/test_stray.py: 2\n")


def test_counts_at_their_floors_pass():
    assert counter.shortfalls(FULL, FULL) == []


def test_a_lost_directory_fails_every_layer_it_held():
    only_functional = counter.count_by_layer("functional_tests/test_f.py: 6\n")
    problems = counter.shortfalls(only_functional, FULL)
    assert [p.split(":")[0] for p in problems] == ["unit", "distributed", "integration", "gpu"]


def test_a_lost_file_falls_below_its_layers_floor():
    listing = LISTING.replace("tests/distributed/test_c.py: 2\n", "")
    problems = counter.shortfalls(counter.count_by_layer(listing), FULL)
    assert problems == ["distributed: 0 tests collected, floor 2"]


def test_a_layer_without_a_floor_fails():
    floors = {layer: n for layer, n in FULL.items() if layer != "gpu"}
    assert counter.shortfalls(FULL, floors) == ["gpu: no floor recorded in collection_floors.json"]


def test_raising_never_lowers_a_floor():
    counts = {**FULL, "unit": 9, "gpu": 0}
    assert counter.raised(counts, FULL) == {**FULL, "unit": 9}


def test_a_collection_error_is_a_failure(tmp_path):
    broken = tmp_path / "test_broken.py"
    broken.write_text("import module_that_does_not_exist\n\ndef test_x():\n    pass\n")
    with pytest.raises(RuntimeError, match="collection failed"):
        counter.collect([str(broken)])


def test_the_recorded_floors_name_every_layer():
    floors = json.loads(counter.FLOORS.read_text())
    assert sorted(floors) == sorted(counter.LAYERS)
    assert all(isinstance(n, int) and n > 0 for n in floors.values())


def test_one_file_lost_from_a_layer_that_keeps_others_fails():
    """The unit layer keeps ``test_a.py`` but loses ``scheduling/test_b.py``: 3 tests of a floor
    of 7, a layer still collected (not empty), so only the floor itself catches it."""
    listing = LISTING.replace("tests/unit/scheduling/test_b.py: 4\n", "")
    counts = counter.count_by_layer(listing)
    assert counts["unit"] == 3
    assert counter.shortfalls(counts, FULL) == ["unit: 3 tests collected, floor 7"]


def test_a_single_test_below_the_floor_fails():
    """A floor is exact: a large layer one test short of it fails (a floor check loosened by
    any margin passes this)."""
    floors = {**FULL, "unit": 500}
    counts = {**FULL, "unit": 499}
    assert counter.shortfalls(counts, floors) == ["unit: 499 tests collected, floor 500"]
    assert counter.shortfalls({**counts, "unit": 500}, floors) == []
