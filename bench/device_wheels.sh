#!/usr/bin/env bash
# Here, once per session that has a GPU machine: download to .whl/ the daemon's requirements that the
# device image ('cuda': Python 3.12, torch, transformers) lacks, for bench/device_goodput.sh to install.
# The list is stagerd's requirements minus the image's packages (the device tool's KINDS.md), with the
# versions of tests/constraints.txt; fsspec goes too because s3fs pins its own release exactly.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
rm -rf .whl
pins=()
for name in aiobotocore aioitertools annotated-types botocore jmespath pydantic pydantic-core \
    pydantic-settings python-dotenv s3fs typing-inspection watchfiles fsspec; do
    pins+=("$(grep -i "^${name//-/[-_]}==" tests/constraints.txt)")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
du -sh .whl
