"""The built-in job from the command line: `python -m engine.main --flag=value ...`.

Image classification (engine/tasks/image_classification.py) run through
engine/cli.py, the same helper users' own scripts call: the engine's flags,
the task's flags (--model, --dataset, ...), one line on stderr and the exit
code of docs/reference/exit-codes.md for every way a run can end.
"""
from engine import cli
from engine.tasks import image_classification


def run(argv=None) -> None:
  module = cli.caller_module(depth=1)
  image_classification.define_flags(module_name=module)
  cli.define_flags(module_name=module)
  cli.run(image_classification.from_flags, argv=argv)


if __name__ == "__main__":
  run()
