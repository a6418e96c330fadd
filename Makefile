# `make serve`: set up and serve the demo model.   `make test`: set up and run the tests.
.PHONY: setup setup-test serve test test-budget

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test

serve: setup
	.venv/bin/xlaserve serve $(ARGS)

test: setup-test
	.venv/bin/python -m pytest -q $(ARGS)

# The suite with each module's time and memory written to build/test-budget.md.
test-budget: setup-test
	mkdir -p build
	.venv/bin/python -m pytest -q --budget-report=build/test-budget.md $(ARGS)
