# Two commands set everything up on a fresh machine with Python 3.11:
#   make run   creates .venv, installs the project, trains the default job
#   make test  same bootstrap, runs the whole suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The default job is sized to finish well under 3 minutes on 2 CPU cores:
# small_cnn on 32x32 synthetic images, 2 logical CPU devices as replicas.
# Each `make run` trains from scratch into its own runs/<time> directory (a
# finished model_dir would have nothing left to train).
RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S-%N)
RUN_FLAGS ?= --model=small_cnn --dataset=synthetic --image_size=32 --cpu_devices=2 \
	--epochs=8 --batch_size_per_replica=32 --log_every=20 --model_dir=$(RUN_DIR)

.PHONY: run test venv clean bench

venv: $(STAMP)

# uv installs: it fetches in parallel and links the 2.4 GB of packages from
# its cache (~/.cache/uv) instead of unpacking them again: ~25 s where pip
# takes 60-75 s. pip, which the venv has anyway, installs uv; where uv cannot
# install (an index set only in pip's own configuration, say), pip does.
# Both compile what they install but not this (editable) project: compileall
# does, once, so that the many processes of `make test` do not each compile
# it again where PYTHONDONTWRITEBYTECODE is set.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	{ $(PY) -m pip install --quiet uv && \
	  $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode -e '.[test]'; } || \
	  $(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m compileall -q engine data models benchmarks examples tests
	sync  # what the install wrote, to disk now, not behind the first run's writes
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m engine.main $(RUN_FLAGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

bench: $(STAMP)
	$(PY) -m benchmarks.throughput

clean:
	rm -rf $(VENV) build *.egg-info
