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


def test_worker_skew_splits_a_step_into_compute_wait_and_transfer():
  from benchmarks import worker_skew  # pylint: disable=g-import-not-at-top
  # (start, end) ms of each step's gradient all-reduce on the two workers.
  chief = [(100.0, 150.0), (300.0, 340.0), (520.0, 560.0)]
  other = [(120.0, 150.0), (310.0, 340.0), (500.0, 561.0)]
  rows = worker_skew.breakdown(chief, other)
  assert [r["compute"] for r in rows] == [[150.0, 160.0], [180.0, 160.0]]
  assert [r["skew"] for r in rows] == [10.0, 20.0]
  assert [r["transfer"] for r in rows] == [30.0, 41.0]  # after both arrived
  assert [r["step"] for r in rows] == [[200.0, 190.0], [220.0, 190.0]]
  text = worker_skew.report(rows)
  assert text.splitlines()[-1] == (
      "medians (ms): compute 162.5 (w0 165.0, w1 160.0), skew 15.0, "
      "transfer 35.5, step 200.0; compute / step = 0.812")


def test_worker_skew_takes_each_steps_last_ending_collective(monkeypatch):
  from benchmarks import worker_skew  # pylint: disable=g-import-not-at-top
  name = "x/while/body/_1/while/CollectiveReduceV2:CollectiveReduceV2"
  events = [("/host:CPU", "t", name, start, length) for start, length in (
      (0.0, 1.0), (2.0, 10.0), (20.0, 1.0), (22.0, 3.0))] + [
          ("/host:CPU", "t", "CollectiveReduceV2:CollectiveReduceV2", 5.0,
           99.0)]  # outside the loop: the host call's stop vote
  monkeypatch.setattr(worker_skew.xplane_summary, "events",
                      lambda directory: iter(events))
  assert worker_skew.gradient_all_reduces("d", steps=2) == [
      (2.0, 12.0), (22.0, 25.0)]
  with pytest.raises(SystemExit, match="4 collectives in the training loop "
                     "for 3 traced steps"):
    worker_skew.gradient_all_reduces("d", steps=3)
