#!/usr/bin/env bash
# Ember's device check as one command; tools/device_check.py says what each part measures.
#
#   tools/device_check.sh                # the offline GPU runner (Python 3.12 with torch and
#                                        # transformers, no network), .device_wheels/ carried
#   tools/device_check.sh --cpu-dry-run  # anywhere uv is: the same parts on the CPU, CI-sized,
#                                        # in the locked environment, nothing installed
#   tools/device_check.sh --requirements-only  # the GPU form's install, then only its
#                                        # requirement check (no GPU needed): whether the
#                                        # carried wheels complete the image; the first
#                                        # command on a runner, before the check itself
#
# On the GPU it first installs, without network and into a scratch folder put first on
# PYTHONPATH, the wheels of .device_wheels/ (tools/device_wheels.sh fills it on a machine with
# network: megatron-core, transformers, packaging and the rest at their uv.lock versions, and
# the workspace's build backend), then ember's own packages from this checkout with that
# backend; their entry points are how the check finds the plugins.
#
# Results: device_check.json and device_check.log in $OUT (the GPU runner's output folder;
# runs/device_check/ where it is unset), or the JSON named by --out with the log beside it.
# The exit status is non-zero when any part failed.
# Settings: PYTHON (python3), EMBER_DEVICE_WHEELS (.device_wheels), EMBER_DEVICE_SITE (the
# scratch folder), EMBER_DEVICE_CHECK_TIMEOUT (seconds the check itself may run: 420).
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
requirements_only=0
json="${OUT:-runs/device_check}/device_check.json"
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-dry-run) dry_run=1 ;;
        --requirements-only) requirements_only=1 ;;
        --out) json="$2"; shift ;;
        *) echo "usage: tools/device_check.sh [--cpu-dry-run | --requirements-only] [--out FILE.json]" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$(dirname "$json")"
log="${json%.json}.log"
limit="${EMBER_DEVICE_CHECK_TIMEOUT:-420}"
# Every model is built or exported by the check itself; nothing may come from a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

if [ "$dry_run" = 1 ]; then
    CUDA_VISIBLE_DEVICES="" timeout "$limit" \
        uv run --locked python tools/device_check.py --cpu-dry-run --out "$json" 2>&1 | tee "$log"
    exit 0  # pipefail: a failed check has already ended the script with its status
fi

python="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore  # the runner's commands run as root
wheels="${EMBER_DEVICE_WHEELS:-.device_wheels}"
site="${EMBER_DEVICE_SITE:-${TMPDIR:-/tmp}/ember-device-site}"
{
    shopt -s nullglob
    carried=("$wheels"/*.whl)
    if [ ${#carried[@]} -eq 0 ]; then
        echo "device_check: no wheels in $wheels/; run tools/device_wheels.sh on a machine" \
            "with network and carry that folder" >&2
        exit 2
    fi
    started=$SECONDS
    rm -rf "$site"
    mkdir -p "$site"
    site="$(cd "$site" && pwd)"
    install=("$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir
        --disable-pip-version-check --upgrade --target "$site")
    "${install[@]}" "${carried[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # --no-build-isolation: the build backend (hatchling) comes from the wheels just installed.
    # Not `ember` itself: its CLI and driver need Ray, which the runner has no room for.
    members=(packages/core packages/megatron_backend packages/rollout plugins/r3_routing
        plugins/ci_kl_checker)
    "${install[@]}" --no-build-isolation "${members[@]}"
    echo "device_check: ${#carried[@]} wheels and ${#members[@]} ember packages installed" \
        "into $site in $((SECONDS - started)) s"
    if [ "$requirements_only" = 1 ]; then
        "$python" tools/device_check.py --requirements-only
    else
        timeout "$limit" "$python" tools/device_check.py --out "$json"
    fi
} 2>&1 | tee "$log"
