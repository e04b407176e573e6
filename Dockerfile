# realtime-omni: the gateway and every stage process in one image.
#   docker build -t realtime-omni .
#   docker run --rm -p 8000:8000 --shm-size 2g realtime-omni          # the tiny CPU model; its
#                                    log's ready line prints the API key it made for the run
# GPUs: see docker-compose.yml (profile `gpu`) and docs/deployment.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

# The optional parts installed (pyproject.toml's extras). For stages on a Ray cluster and payloads
# through Mooncake: docker build --build-arg EXTRAS=sip,aec,ray,mooncake -t realtime-omni .
ARG EXTRAS=sip,aec

# libgomp: torch's OpenMP runtime; libopus/libvpx/libsrtp come with the av and aiortc wheels;
# libibverbs1 and libnuma1: what Mooncake's transfer engine links, when it is installed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
        $(case ",$EXTRAS," in *,mooncake,*) echo libibverbs1 libnuma1;; esac) \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY realtime_omni ./realtime_omni
COPY configs ./configs
COPY web ./web
# Editable: the package finds configs/ and its .cache/ (the tiny model) beside it in /app.
RUN pip install -e ".[$EXTRAS]"

# Smart Turn v3.2 (BSD 2-clause) out of the pipecat-ai wheel the Makefile pins, checked by its
# sha256, where the server finds it: semantic_vad then ends a turn when it sounds complete.
RUN pip download -q --no-deps -d /tmp/pipecat "pipecat-ai==1.14.0" \
    && python -m realtime_omni.models.smart_turn install /tmp/pipecat/pipecat_ai-1.14.0-py3-none-any.whl \
    && rm -rf /tmp/pipecat

# The tiny model is built here once, so a container starts without building it.
RUN python -c "from realtime_omni.models.qwen3_omni.tiny import ensure_tiny; ensure_tiny(0)"

EXPOSE 8000
# 0.0.0.0 inside the container, so never without a key: set REALTIME_OMNI_API_KEYS, or the server
# makes a key for the run and prints it (--generate-api-key). `docker run -p 8000:8000` is then
# reached as localhost:8000; for other names, set realtime.allowed_hosts (docs/deployment.md).
CMD ["realtime-omni", "serve", "--config", "configs/tiny.yaml", "--host", "0.0.0.0", "--port", "8000", "--generate-api-key"]
