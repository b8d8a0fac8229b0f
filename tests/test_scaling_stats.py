"""benchmarks.scaling's statistics (the benchmark itself takes minutes)."""
import pytest

from benchmarks import scaling


def test_efficiency_pairs_each_repeat_with_its_own_ceiling():
  b, c = [100.0, 120.0, 110.0], [95.0, 108.0, 110.0]
  paired, of_medians, each = scaling.efficiency(b, c)
  assert each == pytest.approx([0.95, 0.9, 1.0])
  assert paired == pytest.approx(0.95)
  assert of_medians == pytest.approx(108.0 / 110.0)


def test_every_set_up_takes_every_place_in_the_order():
  jobs = ["b", "c", "c1"]
  orders = [scaling.rotated(jobs, k) for k in range(3)]
  assert orders == [["b", "c", "c1"], ["c", "c1", "b"], ["c1", "b", "c"]]
  for place in range(3):
    assert sorted(o[place] for o in orders) == sorted(jobs)
