"""Corpora and their preparation, read at run time from what the machine has (nothing shipped).

- ``text``: sentencepiece models, encoding, fairseq-preprocess options, shared by every text path;
- ``ding``: German-English sentence pairs from Debian's Ding dictionary (``trans-de-en``, GPL);
- ``bible``: English-Spanish verse pairs from Debian's public-domain SWORD Bibles, whole books
  held out for validation and test;
- ``agreement``: a subject-verb agreement classification set from Ding's English side
  (Nguyen et al.'s Table 5 task);
- ``speech_corpus``: the English side of Ding's pairs or of the Bible verses spoken by espeak-ng,
  a synthetic corpus in MuST-C's layout;
- ``mustc``: MuST-C (or that synthetic corpus) to fairseq's ``speech_to_text`` manifests.

The scripts in ``scripts/`` and ``scripts/data/`` call the ``main`` of these modules.
"""
