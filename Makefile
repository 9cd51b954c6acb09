# The README's two commands live here. Each creates .venv and installs what it needs on a fresh machine.
#   make demo   train a small GPT on Tiny Shakespeare on the CPU (~2 minutes on 2 cores), then sample from it
#   make chat   the CPU chat recipe in one command (gptforge pipeline chat-cpu): a chat model and its report.md
#   make test   lint and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SHARED ?= ../shared/data
BIN := $(VENV)/bin
# Tiny Shakespeare: the offline copy in ../shared when present, else `gptforge prepare` downloads it.
SHAKESPEARE ?= $(wildcard $(SHARED)/tinyshakespeare/input.txt)

.PHONY: demo chat test install lint chromium golang clean

# the demo needs gptforge alone (torch, numpy, tiktoken, tqdm, rustbpe); the tests also need the [test] extra
$(BIN)/gptforge: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.test-extra: $(BIN)/gptforge
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/gptforge

demo: install
	$(BIN)/gptforge prepare shakespeare_char $(if $(SHAKESPEARE),--input $(SHAKESPEARE))
	$(BIN)/gptforge train config/train_shakespeare_char_cpu.py
	$(BIN)/gptforge sample --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=300

chat: install
	$(BIN)/python -m pip install --quiet -e '.[chat,hf]'
	$(BIN)/gptforge pipeline chat-cpu $(if $(SHAKESPEARE),--text.shakespeare=$(abspath $(SHAKESPEARE)))

lint: $(VENV)/.test-extra
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

# The browser test drives Debian's chromium (playwright's own browser download needs the internet).
chromium:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# Go's text/template checks the Ollama Modelfile's template (Ollama itself does not install from the registries).
golang:
	command -v go >/dev/null || (apt-get update && apt-get install -y golang-go)

# A worker per core (pytest-xdist), each test file on one worker (its module fixtures built once), one thread each.
test: lint chromium golang $(VENV)/.test-extra
	$(BIN)/python -m pytest -n auto --dist loadfile --durations=15  # the slowest tests: where CI time goes

clean:
	rm -rf $(VENV) out-shakespeare-char data/shakespeare_char .pytest_cache
