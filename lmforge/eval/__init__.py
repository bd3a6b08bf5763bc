"""Downstream evaluation: lm-evaluation-harness on lmforge models, offline.

    lm.py        LMForgeLM, lm-eval's model interface ("lmforge" in its registry) over an lmforge model
    scoring.py   batched continuation log-likelihoods (the output head only where a token is scored)
    harness.py   tasks by name, built offline one by one; lm-eval's evaluator; results table and JSON
    data.py      task data from local JSONL/JSON/TSV/CSV files (custom_dataset), WikiText helpers
    tasks/       lmforge's task YAMLs over local files: wikitext2_local, sst2_local

lm-eval is an optional dependency (pip install -e ".[eval]"); this package imports it only in lm.py
and inside functions, so `import lmforge.eval` never needs it.
"""
