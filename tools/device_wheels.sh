#!/usr/bin/env bash
# Download into .device_wheels/ (git-ignored) the wheels that tools/device_check.sh installs on
# the offline GPU runner, whose image has Python 3.12, torch, transformers 5.17 and the other
# common packages but nothing of Ember's own stack. Run it on a machine with network, then
# carry the folder with the check. It fetches, for CPython 3.12 on manylinux x86_64:
#   - megatron-core and transformers at their uv.lock versions, checked against uv.lock's
#     hashes (the image has no megatron-core, and ember-rollout needs transformers >= 5.19);
#   - math-verify with the two requirements of its that the image lacks (latex2sympy2-extended,
#     antlr4-python3-runtime; sympy is there), also locked: ember-rollout requires it, and the
#     check's environment part fails on any unmet requirement of the packages it installs;
#   - packaging and pluggy, locked too: the image has both, at versions never read there, and
#     the build below needs packaging >= 24.2 (hatchling 1.33 imports packaging.licenses,
#     metadata/core.py 702; megatron-core 0.16.1 needs it too) and pluggy >= 1.0 before any
#     requirement can be checked;
#   - hatchling, the build backend of every workspace member, with the requirements of its
#     that the image lacks or holds at an unread version (uv.lock records no build backends,
#     so these are pinned here).
# tools/device_image.txt lists the image's packages, with the versions that were read there;
# integration_tests/test_device_check.py checks every requirement against them and these.
# Everything else the check imports is in the image. It prints the folder's size: the wheels
# travel with the working tree, 64 MiB in all.
# Settings: PYTHON (python3, >= 3.11, with pip; else `uvx pip`), EMBER_DEVICE_WHEELS.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
dest="${EMBER_DEVICE_WHEELS:-.device_wheels}"
LOCKED=(megatron-core transformers math-verify latex2sympy2-extended antlr4-python3-runtime packaging pluggy)
BUILD_BACKEND=(hatchling==1.33.0 trove-classifiers==2026.9.21.13 tomlkit==0.15.2 pathspec==1.1.1)
LIMIT_MIB=64

if "$python" -m pip --version >/dev/null 2>&1; then
    pip=("$python" -m pip)
else
    pip=(uvx pip)  # pip itself from PyPI, in uv's throwaway environment
fi
download=("${pip[@]}" download --quiet --disable-pip-version-check --no-deps
    --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --dest "$dest")

mkdir -p "$dest"
rm -f "$dest"/*.whl  # one version of each: two would stop the install there

# "name==version --hash=sha256:..." lines from uv.lock: pip refuses a wheel whose hash differs.
requirements="$dest/locked.txt"
"$python" - "${LOCKED[@]}" >"$requirements" <<'PY'
import sys
import tomllib

with open("uv.lock", "rb") as f:
    packages = tomllib.load(f)["package"]
for name in sys.argv[1:]:
    found = [p for p in packages if p["name"] == name]
    if len(found) != 1:
        sys.exit(f"device_wheels: uv.lock has {len(found)} entries for {name}; expected one")
    hashes = " ".join(f"--hash={w['hash']}" for w in found[0].get("wheels", []))
    print(f"{name}=={found[0]['version']} {hashes}")
PY
"${download[@]}" --require-hashes -r "$requirements"
rm -f "$requirements"
"${download[@]}" "${BUILD_BACKEND[@]}"

"$python" - "$dest" "$LIMIT_MIB" <<'PY'
import subprocess
import sys
from pathlib import Path

dest, limit = Path(sys.argv[1]), int(sys.argv[2])
wheels = sorted(dest.glob("*.whl"))
for wheel in wheels:
    print(f"  {wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
carried = sum(w.stat().st_size for w in wheels)
# The working tree travels too: tracked files and untracked ones git does not ignore.
listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    capture_output=True,
    check=True,
).stdout.split(b"\0")
tree = sum(Path(p.decode()).stat().st_size for p in listed if p and Path(p.decode()).is_file())
total = carried + tree
print(
    f"device_wheels: {len(wheels)} wheels, {carried / 2**20:.2f} MiB in {dest}/; with the "
    f"working tree ({tree / 2**20:.2f} MiB) {total / 2**20:.2f} MiB of the {limit} MiB carried"
)
if total >= limit * 2**20:
    sys.exit(f"device_wheels: over the {limit} MiB that can be carried")
PY
