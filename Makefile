# Two commands: `make run` (main job) and `make test` (the suite CI runs). `make bench`: the performance
# report: every script whose results file the README cites, then the README's rendered tables (about an hour
# on 2 cores, an estimate: the scripts' own run times summed; run it on an otherwise idle machine).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The main job needs the package and its own dependencies only; the test extra (PyTorch, transformers, lm-eval,
# peft, SAELens: the suite's references) is installed by the targets that run the suite.
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e .
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $@

install: $(BIN)/.installed

install-test: $(BIN)/.installed-test

run: install
	$(BIN)/jaxformer train configs/reverse.py

test: install-test
	$(BIN)/python -m pytest -n 2 --dist loadfile -rs --durations=25

test-slow: install-test
	$(BIN)/python -m pytest -n 2 --dist loadfile -rs -m "slow or gpu"

# The GPU lane: accelerator kernels and the model on them (skips what this machine cannot run, with the reason);
# each result appended to test-gpu.log as it ends. On a CPU the Pallas cases run in interpret mode.
test-gpu: install-test
	JAXFORMER_TEST_LOG=test-gpu.log $(BIN)/python -m pytest -rs -m gpu

# The documentation site (mkdocs.yml): --strict, so a broken link or an unresolved API reference fails; CI runs it.
docs: install-test
	$(BIN)/pip install -q -c constraints.txt -e ".[test,docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Mutation testing (tools/mutation.py): mutmut 3 on each module named, the default-lane tests that cover it (from
# tests/mutation.toml); the scores go to tests/mutation_scores.json and docs/mutation.md. E.g.
# `make mutants MODULES=jaxformer/patching.py`; without MODULES, every module listed (hours on 2 cores).
mutants: install-test
	$(BIN)/pip install -q -c constraints.txt -e ".[test,dev]"
	$(BIN)/python tools/mutation.py $(MODULES)

test-all: install-test
	$(BIN)/python -m pytest -n 2 --dist loadfile -rs -m "slow or not slow or gpu"

bench: install-test
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/step_profile.py
	$(BIN)/python benchmarks/kernels.py
	$(BIN)/python benchmarks/decode.py --sizes tiny base --batches 1 8 --contexts 64 256 1024 --reps 7
	$(BIN)/python benchmarks/decode_profile.py
	$(BIN)/python benchmarks/make_run.py --against 40eb631 --runs 6
	$(BIN)/python benchmarks/quantize.py
	$(BIN)/python benchmarks/attention.py --reps 3
	$(BIN)/python benchmarks/cache_layout.py --reps 5
	$(BIN)/python benchmarks/parallel.py --devices 8 --steps 5
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/context_memory.py
	$(BIN)/python benchmarks/pipeline_bubble.py
	$(BIN)/python benchmarks/levers.py
	$(BIN)/python tools/readme_tables.py

.PHONY: install install-test run test test-slow test-gpu test-all bench docs mutants
