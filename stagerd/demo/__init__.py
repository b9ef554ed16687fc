"""`stagerd demo`: the whole pipeline on one machine, with no GPU and no network.

1. Train (`train.py`, with the model of `tiny_model.py`): 2 gloo processes train a tiny FSDP2 language model
   on CPU and save it through `stagerd.Stager` every step. Rank 0 also writes the full trained weights of
   each step to `expected/`, so the check compares against what training really held, not the export.
2. Run the daemon (`run.py`): `stagerd watch ROOT --sink URL --once`, as a child process.
3. Check (`check.py`, reading back through `fetch.py`): load every published step with `safetensors` and
   compare it bit for bit with `expected/`. `summary.py` prints what happened.

Layout of the demo directory (`plan.py`): `staging/` (the ROOT), `published/` (the default local sink),
`expected/`, and `downloaded/` for copies read back from a remote sink.
"""
