# StarSun. `make demo` and `make test` each work alone on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch for this CPU machine (a local CPU build); override e.g. TORCH='torch==2.5.0' on other hosts.
TORCH   ?= torch==2.13.0
# llama.cpp from source for this CPU, AMX off (scripts/llama_wheel.sh says why);
# add -DGGML_NATIVE=OFF for a portable wheel to copy to other devices (README, llama.cpp).
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF
TEST_MODELS ?= smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
DEMO_MODELS ?= qwen2.5-coder-0.5b qwen2.5-coder-1.5b

# the layering contracts of pyproject.toml ([tool.importlinter]); `make test` runs them first
lint: install
	$(BIN)/lint-imports

.PHONY: lint install llama llama-tools system-test certs models test-models demo test bench export flash-jetson clean help

help:
	@echo "make demo    - fetch real models, run the StarSD star, then the SUN shared-decoder demo"
	@echo "make test    - run the whole test suite (installs what it needs)"
	@echo "make models  - fetch every model in docs/models.md (sha256 checked)"
	@echo "make bench   - run the benchmarks (hours on 2 cores; writes benchmarks/results/)"
	@echo "make flash-jetson SSH=user@host PROFILE=.. ROLE=.. BROKER=mqtt://.. MODEL=.. [DRY=1] - provision a device"

$(BIN)/.installed: pyproject.toml
	@$(PY) -c 'import venv, ensurepip' 2>/dev/null || bash scripts/ensure_system.sh venv
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[torch,onnx,hub,export,test,bench,tasks]"
	$(BIN)/pip install -q --no-deps "bfcl-eval==2026.3.23"  # its deps pin an old numpy and pull torch
	touch $@

install: $(BIN)/.installed

# llama-cpp-python builds from source (minutes), never from pip's wheel cache; the wheel is
# kept in ~/.cache/starsun/wheels under a key of the flags and this CPU's features.
$(BIN)/.llama: $(BIN)/.installed scripts/llama_wheel.sh
	bash scripts/ensure_system.sh compiler
	LLAMA_CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" bash scripts/llama_wheel.sh $(BIN)
	touch $@

llama: $(BIN)/.llama

models: install
	$(BIN)/python -m edge.model.fetch

test-models: install
	$(BIN)/python -m edge.model.fetch $(TEST_MODELS)

demo: install llama
	$(BIN)/python -m edge.model.fetch $(DEMO_MODELS)
	$(BIN)/edge-hub demo
	$(BIN)/edge-hub demo-sun

# the services the tests need: Mosquitto, RabbitMQ, sshd, rsync, iproute2 (network namespaces; root)
system-test:
	bash scripts/ensure_system.sh mosquitto rabbitmq ssh sshd rsync netns

test: system-test install llama test-models
	$(BIN)/lint-imports
	bash scripts/run_tests.sh $(BIN)

# every benchmark but sun_accuracy (hours; run it in the background, it resumes), each as a module
# from the repository root (python -m benchmarks lists them); each writes
# benchmarks/results/<script>/default.* (device: <profile>.*); benchmarks/results/README.md says
# which variant is each question's figure of record and the command that made it
bench: install llama models
	$(BIN)/python -m benchmarks.star.protocol_overhead
	$(BIN)/python -m benchmarks.engines.backends --rounds 2
	$(BIN)/python -m benchmarks.engines.torch_engine_costs
	$(BIN)/python -m benchmarks.sun.qsun_speed
	$(BIN)/python -m benchmarks.sun.sun_serving
	$(BIN)/python -m benchmarks.star.starsd_scaling
	$(BIN)/python -m benchmarks.star.draft_formats
	$(BIN)/python -m benchmarks.speculative.local_spec
	$(BIN)/python -m benchmarks.star.starsd_two_device
	$(BIN)/python -m benchmarks.speculative.native_spec
	$(BIN)/python -m benchmarks.device.device --profile $(or $(PROFILE),cpu-2core)

# llama.cpp's own tools (llama-speculative-simple, llama-server, ...) from the vendored source, AMX off:
# the native peer of benchmarks/speculative/native_spec.py (minutes; kept in ~/.cache/starsun/llama-tools-*)
llama-tools: install
	bash scripts/ensure_system.sh compiler cmake
	bash scripts/llama_tools.sh $(BIN)

# make flash-jetson SSH=user@host PROFILE=jetson-orin-nano-8gb ROLE=target|draft|prefill|decoder
#   BROKER=mqtt://pc:1883 (BUNDLE=dir | MODEL=name-or-file | MODULE=dir) [CLIENT_ID=..] [MAX_LEN=..] [DRY=1]
#   [ARGS="--password-file f --deps device ..."]   (python -m devices.provision --help: every option)
flash-jetson: install
	$(if $(DEVICE),$(error DEVICE= is gone: write SSH=user@host),)
	$(if $(HUB),$(error HUB= is gone: write BROKER=mqtt://HOST:PORT),)
	bash scripts/ensure_system.sh ssh rsync
	$(BIN)/python -m devices.provision $(if $(SSH),--ssh $(SSH),) \
	  $(if $(PROFILE),--profile $(PROFILE),) $(if $(ROLE),--role $(ROLE),) \
	  $(if $(BROKER),--broker $(BROKER),) $(if $(BUNDLE),--bundle $(BUNDLE),) $(if $(MODEL),--model $(MODEL),) \
	  $(if $(MODULE),--module $(MODULE),) $(if $(CLIENT_ID),--client-id $(CLIENT_ID),) \
	  $(if $(MAX_LEN),--max-len $(MAX_LEN),) $(if $(DRY),--dry-run,) $(ARGS)

# the star's CA, the broker's certificate and one per device:
# make certs HOSTS="hub.local 192.168.1.10" DEVICES="jetson1 jetson2" [CERTS=certs]
CERTS ?= certs
certs: install
	$(BIN)/edge-hub certs --out $(CERTS) $(foreach h,$(HOSTS),--host $(h)) $(foreach d,$(DEVICES),--client-id $(d))

clean:
	rm -rf $(VENV) build *.egg-info
