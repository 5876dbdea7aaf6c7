# The two commands of the README. Both are idempotent and set everything up on first use.
.PHONY: run test setup install-services stop

TS := .venv/bin/tokenstream

setup:
	@bash deploy/bootstrap.sh

install-services: setup
	@$(TS) stack install

## make run: the local system (stack and topics today; each role joins as it lands)
run: install-services
	@$(TS) stack up
	@$(TS) topics apply
	@$(TS) stack status

## make test: the whole suite against a real Kafka, Redis and Weaviate it starts on free ports
test: install-services
	.venv/bin/python -m pytest -ra $(PYTEST_ARGS)

stop:
	@$(TS) stack down
