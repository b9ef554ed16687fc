#!/bin/bash
# Paired A/B of `stagerd publish` to a file:// sink: base tree vs HEAD, alternated, with `cp -r` + sync of
# the same export as the peer. usage: bench/ab_publish_file.sh BASE_TREE HEAD_TREE [ROUNDS] (two checkouts, C extensions built)
set -eu
BASE=$1; HEAD=$2; N=${3:-7}
D=$(mktemp -d "${TMPDIR:-/tmp}/ab-publish.XXXX")
. "$(dirname "$0")/../.venv/bin/activate"
python - "$D/export" <<'PY'
import os, sys, json, numpy as np
from safetensors.numpy import save_file
out = sys.argv[1]; os.makedirs(out)
rng = np.random.default_rng(0); weight_map = {}
for i in range(60):  # 60 files x ~8 MB = ~480 MB, 20 tensors each
    name = f"model-{i+1:05d}-of-00060.safetensors"
    t = {f"layers.{i}.w{j}": rng.standard_normal(100_000, dtype=np.float32) for j in range(20)}
    save_file(t, os.path.join(out, name), metadata={"format": "pt"}); weight_map.update({k: name for k in t})
json.dump({"metadata": {"total_size": 60*20*400_000}, "weight_map": weight_map}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
open(os.path.join(out, "config.json"), "w").write("{}")
PY
for r in $(seq 1 $N); do
  for which in base head cp; do
    rm -rf "$D/sink"; mkdir "$D/sink"; sync
    t0=$(date +%s.%N)
    case $which in
      base) PYTHONPATH=$BASE python -m stagerd.cli publish "$D/export" --step $r --sink "file://$D/sink" > /dev/null ;;
      head) PYTHONPATH=$HEAD python -m stagerd.cli publish "$D/export" --step $r --sink "file://$D/sink" > /dev/null ;;
      cp) cp -r "$D/export" "$D/sink/step" && sync -f "$D/sink" ;;
    esac
    t1=$(date +%s.%N)
    echo "$which $(echo "$t1 - $t0" | bc)"
  done
done
rm -rf "$D"
