# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up.
# Any Python >= 3.11 on PATH: the first of python3.11, python3.12, python3.13, python3.14, python3
# that is new enough (or PYTHON=... to choose).
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3.14 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test bench venv system-deps clean

# torch without CUDA: on x86_64 Linux `torch==<locked>+cpu` from the CPU-only index when it answers,
# else from pip's own index/find-links, never PyPI's CUDA build (tools/cputorch.py; docs/install.md).
# XRONOS_TORCH_INDEX=<mirror>|none as for systemd/install.sh; XRONOS_UNAME_M=aarch64 etc. stands in for
# `uname -m` (the tests' make -n). Expanded only when the venv is built.
TORCH_PIP = $(shell $(PYTHON) tools/cputorch.py $(if $(XRONOS_UNAME_M),--machine $(XRONOS_UNAME_M)))

# A venv with pinned installs; redone when the project's requirements change.
$(STAMP): pyproject.toml requirements.lock
	@[ -n "$(PYTHON)" ] || { echo "need Python >= 3.11 on PATH (python3.11 ... python3), or PYTHON=/path/to/python"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "$(PYTHON) is older than Python 3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements.lock $(TORCH_PIP) -e '.[node,broker,bench,demo]'
	touch $(STAMP)

# The tests also need llama-cpp-python (llama.cpp judges the GGUF export), which compiles llama.cpp
# for several minutes: only `make test` pays for it. Portable CPU flags, since -march=native let its
# Q8_0 kernels use AMX, which a VM may advertise and not allow (SIGILL); no llava library.
$(TEST_STAMP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(PY) -m pip install --quiet -c requirements.lock -e '.[node,broker,bench,demo,test]'
	touch $(TEST_STAMP)

venv: $(STAMP)

# Integration tests run against a real Mosquitto, and the appliance test boots a Debian box with
# systemd-nspawn (tests/appliance/test_appliance_box.py). Install what is missing from Debian's
# packages when we are root; otherwise the tests fall back to amqtt / skip the box, and say so.
SYSTEM_PKGS := mosquitto:mosquitto mosquitto_passwd:mosquitto-clients systemd-nspawn:systemd-container \
	debootstrap:debootstrap
system-deps:
	@missing=""; for pair in $(SYSTEM_PKGS); do cmd=$${pair%%:*}; pkg=$${pair#*:}; \
		command -v $$cmd >/dev/null || [ -x /usr/sbin/$$cmd ] || missing="$$missing $$pkg"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing from Debian packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "not installed and cannot be installed here:$$missing (MQTT tests use amqtt, the box test is skipped)"; fi

test: $(TEST_STAMP) system-deps
	$(PY) -m pytest

demo: $(STAMP)
	$(VENV)/bin/xronos demo

# The benchmark grid (not part of `make test`; needs root for cgroup CPU quotas): docs/benchmarks.md.
bench: $(STAMP)
	$(PY) -m xronos.bench.grid

clean:
	rm -rf $(VENV) build *.egg-info
