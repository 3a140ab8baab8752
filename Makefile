# One entry point for people and CI. `make test` creates or reuses .venv, installs, and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast test-browser browser lint localnet clean

$(STAMP): setup.py requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch (on these machines it comes from a local file); GPU users get CUDA builds via requirements.txt.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest tests/unit

# The dashboards and the local network's report in headless Chromium (tests/browser; `make test` leaves them out).
test-browser: $(STAMP) browser
	$(PY) -m pytest -m browser tests/browser

# Debian's Chromium and its WebDriver, installed when missing (as root, or through sudo).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

# The whole subnet on this machine: mock chain, 1 validator, 3 miners, 3 rounds; report in runs/localnet-TIME/.
localnet: $(STAMP)
	$(PY) -m template.localnet --miners 3 --rounds 3

lint: $(STAMP)
	$(PY) -m ruff check template neurons tests benchmarks scripts

clean:
	rm -rf $(VENV) .pytest_cache
