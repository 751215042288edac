#!/bin/bash
# On a lent GPU machine, in the checkout the device tool sent (docs/gpu.md, "A lent machine"); what it
# carries is made here by scripts/gpu_bundle.py.
#   bash scripts/gpu_device.sh stage           call 1: keeps part 1 of SmolLM2's GGUF on the machine
#   bash scripts/gpu_device.sh check [BUDGET [ARGS...]]
#                                  call 2: installs the wheels, joins the GGUF, runs scripts/gpu_check.py
#                                  for BUDGET seconds (default 480; 1 to 540: a device call runs at most
#                                  600 s, and the check gets its budget plus 60 s) with ARGS (--dry-run:
#                                  on the CPU)
# $OUT gets check.json (rewritten after every method, so a call cut short keeps what was done),
# check.log, and at the end profiles.tgz (the measured profiles and each evaluation's summary);
# the check's artefacts stay on the machine ($OUT/check is a link to them, left out of what comes back).
set -u -o pipefail
STAGE=/tmp/selfspec-stage
BUNDLE=.gpu/call2
#: the longest budget a device call holds: it runs at most 600 s, the check its budget plus 60 s
MAX_BUDGET=540
case "${1:-}" in
stage)
  compgen -G ".gpu/call1/*.part1" >/dev/null || {
    echo "stage: no part of the GGUF here (.gpu/call1/*.part1): make the bundle with \`python scripts/gpu_bundle.py\`" \
      "and run this call with carry=['.gpu/call1'] (docs/gpu.md)" >&2; exit 2; }
  mkdir -p "$STAGE" && cp .gpu/call1/*.part1 "$STAGE"/ || exit 1
  ls -l "$STAGE"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__)"
  ;;
check)
  budget=${2:-480}
  # digits only, no leading zero (bash reads 0480 as octal), at most three (no wraparound), then the bound
  [[ "$budget" =~ ^[1-9][0-9]{0,2}$ ]] && (( budget <= MAX_BUDGET )) || {
    echo "check BUDGET: whole seconds from 1 to $MAX_BUDGET (a device call runs at most 600 s, the check its" \
      "budget plus 60 s), got '$budget'" >&2; exit 2; }
  [[ -f "$BUNDLE/manifest.json" ]] || {
    echo "check: no bundle here ($BUNDLE/manifest.json): make it with \`python scripts/gpu_bundle.py\`, run" \
      "\`bash scripts/gpu_device.sh stage\` with carry=['.gpu/call1'], then this check with carry=['$BUNDLE']" \
      "(docs/gpu.md)" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$BUNDLE"/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src SELFSPEC_CACHE=/tmp/selfspec-cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    WANDB_MODE=disabled PYTHONUNBUFFERED=1
  python3 scripts/gpu_bundle.py --join "$BUNDLE" "$STAGE" "$SELFSPEC_CACHE" || exit 1
  work=$(mktemp -d /tmp/selfspec-check-XXXX) && ln -sfn "$work" "$OUT/check" || exit 1
  timeout -k 20 -s INT $((budget + 60)) python3 scripts/gpu_check.py --budget "$budget" --out "$OUT/check.json" \
    --sharegpt "$BUNDLE/sharegpt.json" "${@:3}" \
    2>&1 | tee "$OUT/check.log"
  rc=$?
  (cd "$work" && find . -path '*/profiles/*.json' -o -name summary.json | tar czf "$OUT/profiles.tgz" -T -)
  rm -f "$OUT/check"
  exit $rc
  ;;
*)
  echo "usage: bash scripts/gpu_device.sh stage | check [BUDGET seconds, 1 to $MAX_BUDGET [ARGS...]]" >&2
  exit 2
  ;;
esac
