"""The models through fairseq's CLI and Python API: training, generation, checkpoints."""
