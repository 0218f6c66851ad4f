"""The recipe driver (``local-attn-recipe``): every row of the five papers' result tables,
reproduced at full scale from the hyper-parameters in ``configs/recipes/``.

The modules in stage order; each imports only modules above it:

- ``config``: recipes as data (loading, rows, profiles, ``--override``, fairseq options);
- ``workspace``: where a recipe's data and rows live in its work dir, how its tools run;
- ``corpora``, ``text_preparation``, ``speech``: the prepare stage (raw text or MuST-C ->
  sentencepiece -> fairseq's binaries or speech manifests);
- ``training``: the train stage (fairseq-train with the paper's tokens per update);
- ``averaging``: the average stage (the last checkpoints averaged, closed heads pruned);
- ``scoring``, ``evaluation``: the evaluate stage and its report (BLEU, WER, perplexity and
  model size beside the paper's numbers, written to ``results.json``);
- ``driver``: ``RecipeRun``, a row's stages in order, the rows it starts from first;
- ``cli``: the command line.
"""
