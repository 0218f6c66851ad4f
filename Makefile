# The two entry points of the README; each sets everything up on first use.
#   make demo   real-data demo: Bible en-es, baseline vs transformer_local_tied, one results table
#               (make demo DEMO_ARGS="--corpus ding-de-en": the same on short Ding de-en sentences)
#   make demo-speech   speech translation on spoken Bible verses: ASR, windows from its
#               contributions, ST global vs local, WER/BLEU (about 45 minutes)
#   make demo-lm   language models on the English Bible as one text: transformer_lm vs every
#               head local-64, the same training minutes each, perplexity, continuations
#   make test   the test suite (what CI runs)
VENV ?= $(if $(LOCAL_ATTN_VENV),$(LOCAL_ATTN_VENV),$(CURDIR)/.venv)
PYTHON := $(VENV)/bin/python
export LOCAL_ATTN_VENV := $(VENV)

.PHONY: setup demo demo-speech demo-lm test test-fast bench clean-demo

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PYTHON) scripts/demo.py $(DEMO_ARGS)

demo-speech: setup
	$(PYTHON) scripts/demo_speech.py $(DEMO_ARGS)

demo-lm: setup
	$(PYTHON) scripts/demo_lm.py $(DEMO_ARGS)

test: setup
	$(PYTHON) -m pytest tests $(PYTEST_ARGS)

bench: setup
	$(PYTHON) benchmarks/training_throughput.py $(BENCH_ARGS)

clean-demo:
	rm -rf demo_runs
