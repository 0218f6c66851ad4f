"""Experiment infrastructure behind the demos and the small-scale study.

- ``bible``: the English-Spanish Bible corpus, read from Debian's SWORD modules and aligned by
  verse reference, whole books held out for validation and test;
- ``training_progress``: fairseq's JSON log lines parsed into a live line per training run
  (a progress bar on a terminal, plain periodic lines in logs), and the validation history;
- ``study``: resumable training runs keyed by their settings, trained until validation loss
  stops improving, and the study report with learning curves.

The scripts in ``scripts/`` parse their arguments and call these modules.
"""
