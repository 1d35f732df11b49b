# The two set-up commands of the README: `make demo` and `make test`.
PYTHON := .venv/bin/python

.PHONY: demo test bench matrix soak redis-py-lines bootstrap-demo bootstrap-test

demo: bootstrap-demo
	$(PYTHON) manage.py migrate --noinput -v 0
	$(PYTHON) manage.py distlock_demo

test: bootstrap-test
	$(PYTHON) -m tests.servers -- $(PYTHON) -m pytest $(PYTEST_ARGS)

bench: bootstrap-test
	$(PYTHON) -m tests.servers -- $(PYTHON) -m bench

# The full worker/server matrix of docs/DEPLOYMENT.md (not part of `make test`): prints its tables and
# writes them into the Deployment page.
matrix: bootstrap-test
	$(PYTHON) -m tests.servers --servers postgres,redis,zookeeper,etcd -- $(PYTHON) -m tests.deployment.matrix --write-docs $(PYTEST_ARGS)

# The Redis/Redlock tests under each redis-py release line, one throwaway virtualenv each (not part of `test`).
redis-py-lines:
	scripts/redis-py-lines $(LINES)

bootstrap-demo:
	scripts/bootstrap demo

bootstrap-test:
	scripts/bootstrap test

# Long randomized runs under a random nemesis on every backend (not part of `make test`):
# make soak MINUTES=120 [RUNS=300] [JOBS=2] [SEED=7] [BACKENDS=zookeeper,etcd] [SOAK_ARGS='--replay 12']
MINUTES ?= 10
soak: bootstrap-test
	$(PYTHON) -m tests.servers --servers postgres -- $(PYTHON) -m tests.faults.soak --minutes $(MINUTES) \
		$(if $(RUNS),--runs $(RUNS)) $(if $(JOBS),--jobs $(JOBS)) $(if $(SEED),--seed $(SEED)) \
		$(if $(BACKENDS),--backends $(BACKENDS)) --report docs/SOAK.md $(SOAK_ARGS)
