#!/usr/bin/env bash
# One GPU measurement, run from the source tree on the GPU machine (no network, its own
# Python, torch and Triton): installs the carried wheels in .whl/ with --no-deps into
# /tmp/site (never the project's pins), then runs the kernel tests on real shapes and the
# benchmarks, writing JSON results to $OUT (or bench/results/ when OUT is unset).
#
#   bench/gpu.sh [kernels] [engine] [baseline] [skinny] [gdn-sweep] [profile] [turn-profile]
#                [prefill] [prefill-profile] [serve]
#                (default: the first three)
#
# Wheels to carry in .whl/ (pip download --no-deps for CPython 3.12 manylinux x86_64 on a
# machine with network; one version of each, the project venv's; README.md, "On the GPU"):
# fla-core (baseline); transitions, sqlite-utils, sqlite-fts4, click-default-group; and for
# `serve` (the server and its HTTP clients): fastapi, starlette, uvicorn, pydantic,
# pydantic-core, annotated-types, annotated-doc, typing-inspection, typing-extensions,
# opentelemetry-api, anyio, sniffio, idna, h11, click, httpx, httpcore, certifi,
# prometheus-client, llguidance, pluggy, python-dateutil. The image brings torch, triton,
# numpy, jinja2, tokenizers, safetensors, tqdm and six.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
stages=${*:-kernels engine baseline}
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 - <<'PY'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name())
PY
status=0
for stage in $stages; do
    case $stage in
    kernels)
        python3 -m pytest -q -p no:cacheprovider tests/kernels tests/model/test_cuda_engine.py 2>&1 | tee "$OUT/kernel-tests.txt" | tail -25
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
        python3 -c "from ninfer.bench.kernels import main; raise SystemExit(main('$OUT/kernels-h200.json'))" || status=1
        ;;
    engine)
        python3 -c "from ninfer.bench.gpu_engine import main; raise SystemExit(main('$OUT/engine-h200.json'))" || status=1
        ;;
    skinny)  # the skinny GEMMs against F.linear, and the model step without/with them
        python3 -m ninfer.bench.skinny "$OUT/skinny-h200.json" || status=1
        ;;
    gdn-sweep)  # the GDN prefill under each launch configuration, against fla
        python3 -m ninfer.bench.gdn_sweep "$OUT/gdn-sweep-h200.json" || status=1
        ;;
    turn-profile)  # the next turn inside the engine: steps, kernels, syncs, host ops
        python3 -m ninfer.bench.turn_profile "$OUT/turn-profile-$(python3 -c "from ninfer.bench.serve_outside import card_name; print(card_name('cuda'))").json" || status=1
        ;;
    prefill)  # a cold prefill's TTFT at chunk sizes, against transformers + fla (fla-core wheel)
        python3 -m ninfer.bench.gpu_prefill "$OUT/prefill-chunks-$(python3 -c "from ninfer.bench.serve_outside import card_name; print(card_name('cuda'))").json" || status=1
        ;;
    prefill-profile)  # a long prefill step by step: wall time against its kernels' time
        python3 -m ninfer.bench.prefill_profile --sizes 32768,4096 --json "$OUT/prefill-profile-$(python3 -c "from ninfer.bench.serve_outside import card_name; print(card_name('cuda'))").json" || status=1
        ;;
    profile)  # kernel by kernel: the decode graphs (with and without PDL), the prefill
        python3 -m ninfer.bench.profile "$OUT/profile-h200.json" || status=1
        ;;
    serve)  # the server from outside through HTTP, on anchor-1b made by the product's maker
        # (--text-head: its greedy tokens are ones the tokenizer decodes, so streams carry
        # text; the engine stages' /tmp/ninfer-anchor-1b keeps its random head)
        anchor=/tmp/ninfer-anchor-1b-text
        if [ ! -f "$anchor/model.safetensors" ]; then
            rm -rf "$anchor"
            python3 -m ninfer.cli make-tiny --preset anchor-1b --text-head "$anchor" \
                || { status=1; continue; }
        fi
        card=$(python3 -c "from ninfer.bench.serve_outside import card_name; print(card_name('cuda'))")
        python3 -m ninfer.cli bench serve --device cuda --model "$anchor" \
            --json "$OUT/serve-cuda-$card.json" ${SERVE_ARGS:-} || status=1
        ;;
    baseline)
        python3 -c "from ninfer.bench.gpu_engine import baseline; raise SystemExit(baseline('$OUT/baseline-h200.json'))" || status=1
        ;;
    *) echo "unknown stage $stage"; status=2 ;;
    esac
done
exit $status
