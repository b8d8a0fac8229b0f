#!/usr/bin/env bash
# The Orbit baseline's own environment, for `python -m benchmarks.throughput`:
# TF Model Garden's Orbit (tf-models-official, without its dependencies) and
# tf-keras matching TensorFlow 2.21, in a venv of their own. TensorFlow
# itself is the project's (.venv), reached read-only through a .pth file, so
# both sides run the same TF build. `make test` never needs this.
#
#   bash benchmarks/setup_orbit.sh [venv_dir]    # default benchmarks/.orbit_venv
set -eu
VENV=${1:-benchmarks/.orbit_venv}
BASE=${BASE_PYTHON:-.venv/bin/python}
TF_SITE=$("$BASE" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$("$BASE" -c 'import sys; print(sys.base_prefix)')/bin/python3" -m venv "$VENV"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$TF_SITE" > "$SITE/zz_project_tensorflow.pth"  # after the venv's own
"$VENV/bin/pip" install -q --no-deps "tf-keras==2.21.0" "tf-models-official==2.20.0"
"$VENV/bin/python" - <<'PYEOF'
import orbit, tf_keras, tensorflow as tf
print(f"Orbit from {orbit.__file__}; tf_keras {tf_keras.__version__}; "
      f"TensorFlow {tf.__version__}")
PYEOF
