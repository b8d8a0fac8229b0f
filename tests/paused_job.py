"""The built-in job with one worker paused in a chosen phase, for exit-path tests.

    PAUSE_IN=between|eval|save PAUSE_STEP=K PAUSE_TASK=0 PAUSE_DIR=D \
        python tests/paused_job.py --strategy=multi_worker ...

The task PAUSE_TASK, on reaching step K in that phase, creates D/paused and
waits (at most 120 s) until D/go exists, then goes on as if nothing
happened. The test meanwhile kills a peer, so the phase is where the worker
finds out. Without PAUSE_IN it is `python -m engine.main`.
"""
import os
import time

from absl import flags

from engine import main
from engine import hooks
from engine.core import checkpoint, evaluate, run_hooks

PHASE = os.environ.get("PAUSE_IN", "")
STEP = int(os.environ.get("PAUSE_STEP", "0"))
TASK = int(os.environ.get("PAUSE_TASK", "0"))
DIR = os.environ.get("PAUSE_DIR", "")


def pause():
  open(os.path.join(DIR, "paused"), "w").close()
  deadline = time.monotonic() + 120
  while (not os.path.exists(os.path.join(DIR, "go")) and
         time.monotonic() < deadline):
    time.sleep(0.05)


class PauseHook(hooks.Hook):
  """Pauses between host calls at STEP (the hooks run before the exchange)."""

  def next_stop(self, step):
    return STEP if step < STEP else float("inf")

  def after_loop(self, step, rows, seconds):
    if step == STEP:
      pause()


def patch():
  if flags.FLAGS.task_index != TASK:
    return
  if PHASE == "between":
    make = run_hooks.make_hooks

    def with_pause(task, config, setup, state, watch, extra, stop):
      return make(task, config, setup, state, watch, [*extra, PauseHook()],
                  stop)
    run_hooks.make_hooks = with_pause
  elif PHASE == "eval":
    evaluate_once = evaluate.Evaluator.evaluate

    def paused_evaluate(self):
      pause()
      return evaluate_once(self)
    evaluate.Evaluator.evaluate = paused_evaluate
  elif PHASE == "save":
    save = checkpoint.Checkpointer.save

    def paused_save(self, step):
      if step == STEP:
        pause()
      return save(self, step)
    checkpoint.Checkpointer.save = paused_save


if __name__ == "__main__":
  if PHASE:
    make_task = main.image_classification.from_flags

    def patched(config):
      patch()
      return make_task(config)
    main.image_classification.from_flags = patched
  main.run()
