#!/usr/bin/env bash
# pyproject.toml's dependency floors, run: a scratch venv with the local torch 2.13 CPU wheel, each floor
# exactly (tests/floors.txt) and the test tools, then the test folders that need no transformers or
# trainer (or the paths given). RELIABILITY.md ("Dependency floors") records what it gave; about 12
# minutes on 2 cores. VENV=DIR puts the venv elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-/tmp/stagerd-floors}
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q uv
pip install -q -c tests/constraints.txt torch==2.13.0
uv pip install -q -c tests/floors.txt -e . pytest pytest-asyncio pytest-xdist hypothesis 'moto[server]' \
    boto3 pyyaml werkzeug pathspec packaging
uv pip list 2>/dev/null | grep -iE "^($(grep -v '^#' tests/floors.txt | cut -d= -f1 | paste -sd'|')) "
if [ $# -eq 0 ]; then
    set -- tests/engine tests/contract tests/sinks tests/ops tests/cmd tests/daemon
fi
python -m pytest -q -p no:cacheprovider "$@"
