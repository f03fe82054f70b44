# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench venv system-deps clean

# A venv with pinned installs; redone when the project's requirements change.
$(STAMP): pyproject.toml requirements.lock
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements.lock -e '.[node,broker,bench,test]'
	touch $(STAMP)

venv: $(STAMP)

# Integration tests run against a real Mosquitto. Install it from Debian's packages when it
# is missing and we are root; otherwise the tests fall back to amqtt and say so.
system-deps:
	@if command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing mosquitto from Debian packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null; \
	else echo "mosquitto not found and cannot be installed here: integration tests will use amqtt"; fi

test: $(STAMP) system-deps
	$(PY) -m pytest

demo: $(STAMP)
	$(VENV)/bin/xronos demo

# The benchmark grid (not part of `make test`; needs root for cgroup CPU quotas): README "Benchmarks".
bench: $(STAMP)
	$(PY) -m xronos.bench.grid

clean:
	rm -rf $(VENV) build *.egg-info
