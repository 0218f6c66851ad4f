"""Experiment infrastructure: the demos, the small-scale study and what the benchmarks share.

- ``fairseq_runner``: fairseq's tools run in a child process (or in this one) with their output
  in a log, fairseq-train runs side by side with one progress line each, and what an earlier
  run has already done;
- ``training_progress``: fairseq's JSON log lines parsed into a live line per training run
  (a progress bar on a terminal, plain periodic lines in logs), and the validation history;
- ``demo``: baseline against ``transformer_local_tied`` on Ding de-en or Bible en-es, and the
  sizes, schedule and data preparation the other experiments share;
- ``lm_demo``: fairseq's ``transformer_lm`` against ``transformer_lm_local`` with every head
  local, on the English Bible as one text, the same training minutes each (``make demo-lm``);
- ``speech_pipeline``: Alastruey et al.'s steps as fairseq runs them (the speech model and its
  schedule, feature preparation, scoring, the contributions analysis), shared by:
- ``speech_demo``: the speech study in quick form on spoken Bible verses, with the levels that
  show ST learning (before training, test audio shuffled);
- ``prune_demo``: encoder heads gated with the L0 penalty, pruned and scored per lambda;
- ``study``, ``study_report``, ``small_scale_study``: resumable training runs keyed by their
  settings, trained until validation loss stops improving, and the study report with learning
  curves; ``fairseq_train``: fairseq-train with early stopping that survives a restart;
- ``speech_study``: Alastruey et al.'s claim on spoken Bible verses (ASR, windows from its
  contributions, global and local ST arms over seeds) on the same runner and records;
- ``speech_encoder_cost``: a speech encoder's self-attention cost, counted over a corpus's
  lengths and measured (``benchmarks/speech_encoder.py`` and the speech study);
- ``measurement``: timing, peak memory, operation counts, host and GPU time of one call, and
  the useful FLOPs and least memory traffic of a banded attention call, for the benchmarks;
- ``host_overhead``: what one attention call of each mechanism costs against PyTorch's SDPA and
  fairseq's ``MultiheadAttention`` (``benchmarks/host_overhead.py``);
- ``kernel_results``: the kernel benchmark's JSON records as the docs' table
  (``benchmarks/results_table.py``);
- ``lm_layout``: the fairseq-train options that give fairseq's ``transformer_lm`` the layout of
  ``transformer_lm_local`` (input and output dims, pre-norm), for ``lm_demo`` and
  ``long_context``;
- ``long_context``: fairseq's ``transformer_lm`` against ``transformer_lm_local`` at long
  lengths, training and incremental decoding (``benchmarks/long_context.py``), a package of
  small modules (settings, models, memory, training, decoding, benchmark, report); its
  ``models.lm_arguments`` are fairseq-train's arguments for a language model of given sizes.

The scripts in ``scripts/`` and ``benchmarks/`` call these modules.
"""
