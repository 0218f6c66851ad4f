"""The analyses behind ``local-attn-analyze``: where attention is local, and where locality is safe.

Each analysis is a module of maths beside a ``*_cli`` module holding its subcommand's options
(``cli`` registers the subcommands; ``loading`` holds the options and model loading they share):

- ``sensitivity``, ``attention_bias``: Pande et al. 2021 (gamma per token set, Eq. 8's bias);
- ``head_roles`` with ``lrp``: Voita et al. 2019 (confidence, relevance, positional and
  syntactic roles);
- ``learned_windows``: the centres and windows that Yang et al. 2018 and Nguyen et al. 2020 learn;
- ``contributions``: Alastruey et al. 2022 (contributions, CCD, windows from Algorithm 1).
"""
