# The two set-up commands of the README: `make demo` and `make test`.
PYTHON := .venv/bin/python

.PHONY: demo test bench bootstrap-demo bootstrap-test

demo: bootstrap-demo
	$(PYTHON) manage.py migrate --noinput -v 0
	$(PYTHON) manage.py distlock_demo

test: bootstrap-test
	$(PYTHON) -m tests.servers -- $(PYTHON) -m pytest $(PYTEST_ARGS)

bench: bootstrap-test
	$(PYTHON) -m tests.servers -- $(PYTHON) -m bench

bootstrap-demo:
	scripts/bootstrap demo

bootstrap-test:
	scripts/bootstrap test
