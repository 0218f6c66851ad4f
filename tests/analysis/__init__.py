"""The analysis tools on small trained checkpoints, through ``local-attn-analyze``."""
