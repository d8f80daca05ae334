# The README's two commands: `make demo` and `make test`. Both set up first.
PY := .venv/bin/python
PROTOS := $(shell find proto -name '*.proto' | sort)

.PHONY: setup proto lint demo test test-unit bench bench-snapshots bench-startup bench-fuse bench-checkpoint bench-depsnap bench-rss bench-failover bench-jobstart bench-scale clean

setup:
	@scripts/setup.sh

# Reproducible stub generation: the stubs are build outputs, never committed.
proto:
	@$(PY) -m grpc_tools.protoc -I . \
	  -I "$$($(PY) -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')" \
	  --plugin=protoc-gen-mypy_grpc=.venv/bin/protoc-gen-mypy_grpc \
	  --python_out=. --pyi_out=. --grpc_python_out=. --mypy_grpc_out=. $(PROTOS)

demo: setup
	$(PY) -m scripts.demo

# Style first: it takes seconds and fails before the long suite starts.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

test: lint
	$(PY) -m pytest -ra $(PYTEST_ARGS)

# The tests that need no root, daemon or mount (see tests/conftest.py).
test-unit: setup
	$(PY) -m pytest -ra -m "not integration" $(PYTEST_ARGS)

bench: bench-snapshots bench-startup bench-fuse bench-checkpoint bench-depsnap bench-rss bench-failover bench-jobstart bench-scale

bench-snapshots: setup
	$(PY) -m bench.snapshots_latency

bench-startup: setup
	$(PY) -m bench.startup

bench-fuse: setup
	$(PY) -m bench.fusethroughput

bench-checkpoint: setup
	$(PY) -m bench.checkpoint

bench-depsnap: setup
	$(PY) -m bench.depsnap

bench-rss: setup
	$(PY) -m bench.layer_rss

bench-failover: setup
	$(PY) -m bench.failover

bench-jobstart: setup
	$(PY) -m bench.jobstart

bench-scale: setup
	$(PY) -m bench.scale

clean:
	rm -rf .venv build *.egg-info
	find proto -name '*_pb2*.py*' -delete
