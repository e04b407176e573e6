#!/usr/bin/env bash
# Every check that needs a GPU, in one run: the CUDA IPC tests, the transport benchmark with
# its cuda_ipc row, and the batched stages on cuda:0 in bf16 (benchmarks/batch_steps.py: step
# times at batch 1, 8 and 32 for the tiny model and for random weights at the real Qwen3-Omni
# sizes; benchmarks/concurrency.py: first audio at 1, 4 and 16 streams, tiny model on cuda:0;
# benchmarks/kv_memory.py: the thinker's KV pool at the real sizes), and Qwen3-Omni at its
# published widths and depth through every stage (benchmarks/real_width.py). Made for a lent GPU
# machine whose python3 has CUDA torch but cannot reach PyPI (see benchmarks/README.md, "GPU
# checks"):
#
#   benchmarks/gpu_check.sh wheels   here: the runtime's other packages as wheels in .whl/,
#                                    the versions .venv has, for the GPU machine's Python
#   benchmarks/gpu_check.sh          there: install .whl/ (if carried) aside, check, and write
#                                    the results to $OUT (or gpu-check/): the runtime's checks
#   benchmarks/gpu_check.sh stages   there, a second call: the batched model stages
#   benchmarks/gpu_check.sh real     there, a third call: one spoken request with an image, then
#                                    8 at once, through every stage of the real-width model at
#                                    the published depth (70.5 GB of random bf16 weights, built
#                                    where there is room) or the deepest that fits the disk
#   benchmarks/gpu_check.sh wer      there: the real checkpoint's word error rate as a
#                                    transcription session runs it (the thinker, text only) on
#                                    espeak-ng clips of known text that `wheels` made in
#                                    .whl/wer-clips; the checkpoint is $RTO_CHECKPOINT, else
#                                    configs/qwen3-omni-1gpu.yaml's model.path; none there:
#                                    it says so and passes
# Each fits one 600 s device call.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the pipeline runtime imports beyond numpy, ml_dtypes, pyyaml, psutil and pytest, which
# the GPU image has.
PACKAGES="pyzmq msgspec pydantic pydantic_core annotated-types typing-inspection typing_extensions"
# ... and what the model stages import (transformers and its dependencies).
PACKAGES="$PACKAGES transformers huggingface-hub tokenizers safetensors regex tqdm filelock fsspec
    hf-xet httpx2 httpcore2 h11 anyio idna truststore typer click shellingham rich markdown-it-py
    mdurl pygments annotated-doc pillow jinja2 markupsafe"
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}

if [[ "${1:-}" == wheels ]]; then
    [[ -x .venv/bin/pip ]] || { echo "no .venv here: run make install first" >&2; exit 1; }
    rm -rf .whl && mkdir .whl
    for name in $PACKAGES; do
        version=$(.venv/bin/pip show "$name" | sed -n 's/^Version: //p')
        .venv/bin/pip download -q --no-deps --only-binary=:all: -d .whl \
            --python-version "$GPU_PYTHON_VERSION" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 "$name==$version"
    done
    if command -v espeak-ng >/dev/null; then  # the WER check's clips: no espeak-ng there, maybe
        .venv/bin/python benchmarks/transcription_wer.py --make-clips .whl/wer-clips
    fi
    ls .whl
    exit 0
fi

out=${OUT:-gpu-check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/rto-site .whl/*.whl
    export PYTHONPATH=/tmp/rto-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

python3 - <<'EOF' 2>&1 | tee "$out/device.txt"
import platform, torch
assert torch.cuda.is_available(), "torch sees no CUDA device: nothing to check here"
print(platform.python_version(), "torch", torch.__version__, torch.cuda.get_device_name(),
      torch.cuda.device_count(), "device(s)")
EOF
status=0
if [[ "${1:-}" == real ]]; then
    timeout 570 python3 benchmarks/real_width.py --layers auto --device cuda:0 --cache-dir auto \
        --json "$out/real_width.json" 2>&1 | tee "$out/real_width.txt" || status=1
    exit $status
fi
if [[ "${1:-}" == wer ]]; then
    timeout 570 python3 benchmarks/transcription_wer.py --clips .whl/wer-clips \
        --config configs/qwen3-omni-1gpu.yaml --json "$out/wer.json" 2>&1 \
        | tee "$out/wer.txt" || status=1
    exit $status
fi
if [[ "${1:-}" == stages ]]; then
    for model in tiny real; do
        timeout 150 python3 benchmarks/batch_steps.py --model "$model" --device cuda:0 \
            --json "$out/batch_steps_$model.json" 2>&1 | tee "$out/batch_steps_$model.txt" || status=1
    done
    timeout 150 python3 benchmarks/concurrency.py --configs tiny --device cuda:0 --streams 1,4,16 \
        --json "$out/concurrency.json" 2>&1 | tee "$out/concurrency.txt" || status=1
    # The thinker's KV pool at the real sizes, allocated on the device (about 4.3 GiB), with
    # the decode attention's time at 32 rows.
    timeout 60 python3 benchmarks/kv_memory.py --device cuda:0 --json "$out/kv_memory.json" \
        2>&1 | tee "$out/kv_memory.txt" || status=1
    exit $status
fi
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/integration/test_cuda_ipc.py \
    2>&1 | tee "$out/pytest.txt" || status=1
timeout 240 python3 benchmarks/transport.py --rounds 3 --json "$out/transport.json" \
    2>&1 | tee "$out/transport.txt" || status=1
exit $status
