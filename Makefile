# The two commands of the README. Both are idempotent and set everything up on first use.
.PHONY: run test test-all lint setup install-services vllm-venv stop status

TS := .venv/bin/tokenstream

setup:
	@bash deploy/bootstrap.sh

install-services: setup
	@$(TS) stack install

## make run: the whole system locally (Kafka, Redis, Weaviate, topics, processors, a worker, the gateway)
run: install-services
	@$(TS) system up
	@$(TS) system status

## make test: the linter, then the suite against a real Kafka, Redis and Weaviate it starts on free
## ports (all but the `heavy` acceptance runs and drills: about 14 minutes on 2 cores, its budget 15)
test: install-services lint
	.venv/bin/python -m pytest -ra -m "not heavy" $(PYTEST_ARGS)

## make lint: ruff's rules and its formatting (configured in pyproject.toml), changing nothing
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

## vLLM's CPU build in its own virtualenv with the project (the worker's `vllm` backend; once, minutes),
## its allocator (tcmalloc: `setup`), then one start of vLLM per configuration the project starts it in,
## which builds its compile cache (minutes more, once), so a first `worker --backend vllm` starts warm
vllm-venv: setup
	.venv/bin/python -m bench.peers vllm

## make test-all: everything, the heavy runs and drills included, the vLLM backend's too (about 20 minutes more)
test-all: install-services lint vllm-venv
	.venv/bin/python -m pytest -ra $(PYTEST_ARGS)

stop:
	@$(TS) system down

status:
	@$(TS) system status
