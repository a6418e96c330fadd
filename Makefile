# `make serve`: set up and serve the demo model.   `make test`: set up and run the tests.
.PHONY: setup setup-test serve test

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test

serve: setup
	.venv/bin/xlaserve serve $(ARGS)

test: setup-test
	.venv/bin/python -m pytest -q $(ARGS)
