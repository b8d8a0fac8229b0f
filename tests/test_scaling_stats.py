"""benchmarks.scaling's run order and statistics (the benchmark takes minutes)."""
import pytest

from benchmarks import scaling


def test_every_c_runs_between_two_b_runs_in_rotated_order():
  order = scaling.schedule({"c": (), "c1": ()}, repeats=2)
  assert order == ["a", "b", "c", "b", "c1", "a", "b", "c1", "b", "c", "b"]
  assert order[-1] == "b"


def test_each_c_is_paired_with_the_b_on_both_sides():
  order = ["a", "b", "c", "b", "c1", "a", "b", "c1", "b", "c", "b"]
  rates = [50.0, 100.0, 95.0, 110.0, 99.0, 52.0, 120.0, 108.0, 100.0, 90.0,
           80.0]
  paired = scaling.sandwiched(order, rates)
  # c: 95 / mean(100, 110), then 90 / mean(100, 80).
  assert paired["c"] == pytest.approx([95 / 105, 90 / 90])
  # c1: the (b) after the first c1 comes after an (a) run.
  assert paired["c1"] == pytest.approx([99 / 115, 108 / 110])


def test_every_set_up_takes_every_place_in_the_order():
  jobs = ["b", "c", "c1"]
  orders = [scaling.rotated(jobs, k) for k in range(3)]
  assert orders == [["b", "c", "c1"], ["c", "c1", "b"], ["c1", "b", "c"]]
  for place in range(3):
    assert sorted(o[place] for o in orders) == sorted(jobs)
