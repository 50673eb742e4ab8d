"""Studies built on gspo's public API — not part of the training library.

Each module here is an experiment (a study with its own runs, summaries and claims' prose) that uses only the public
names of `gspo` (configs, `gspo.trainer.train`, `gspo.sft.cold_start`, `gspo.tracking.read_metrics`, ...), the way a
user's own script would. Nothing in the library imports this package; `gspo compare` is a thin launcher for
`gspo.experiments.moe_study`.
"""
