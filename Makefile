PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test lint serve bench clean

CONFIG ?= configs/tiny.yaml

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The third-party clients the e2e tests drive, each in an environment of its own (their
# websockets pins clash with openai[realtime]'s): tests/e2e/clients/.
CLIENTS := .cache/venvs

# Smart Turn v3.2's model (BSD 2-clause) out of the pinned pipecat-ai wheel, checked by its
# sha256, into .cache/models/smart_turn/, where the server finds it (realtime.smart_turn_dir).
SMART_TURN_SRC := $(CLIENTS)/pipecat/lib/python3*/site-packages/pipecat/audio/turn/smart_turn/data

install: $(BIN)/python $(CLIENTS)/agents/bin/python $(CLIENTS)/pipecat/bin/python \
		$(CLIENTS)/livekit/bin/python
	$(BIN)/pip install -q -e ".[test,sip,aec,ray,mooncake]"
	$(BIN)/python -m realtime_omni.models.smart_turn install $(SMART_TURN_SRC)

$(CLIENTS)/agents/bin/python:
	$(PY) -m venv $(CLIENTS)/agents
	$(CLIENTS)/agents/bin/pip install -q "openai-agents==0.24.0"

$(CLIENTS)/pipecat/bin/python:
	$(PY) -m venv $(CLIENTS)/pipecat
	$(CLIENTS)/pipecat/bin/pip install -q "pipecat-ai==1.14.0"

# LiveKit Agents with its OpenAI plugin; the plugin builds its events from the openai SDK's
# types, which the e2e test checks the server's events against: pinned with it.
$(CLIENTS)/livekit/bin/python:
	$(PY) -m venv $(CLIENTS)/livekit
	$(CLIENTS)/livekit/bin/pip install -q "livekit-agents==1.8.9" "livekit-plugins-openai==1.8.9" \
		"openai==3.60.0"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy realtime_omni

# Two workers (pytest-xdist), each file whole on one of them (its module fixtures start once):
# most e2e time is real-time audio, half the cores idle in a serial run (1,170 s serial, 718 s
# so, on two cores). One test alone: .venv/bin/python -m pytest tests/path::name
test: install
	$(BIN)/ruff check .
	$(BIN)/mypy realtime_omni
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The gateway on http://127.0.0.1:8000 (OpenAI Realtime WebSocket at /v1/realtime).
serve: install
	$(BIN)/realtime-omni serve --config $(CONFIG)

bench: install
	$(BIN)/python benchmarks/transport.py
	$(BIN)/python benchmarks/first_audio.py
	$(BIN)/python benchmarks/concurrency.py
	$(BIN)/python benchmarks/conversation.py
	$(BIN)/python benchmarks/gc_pause.py
	$(BIN)/python benchmarks/abort.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
