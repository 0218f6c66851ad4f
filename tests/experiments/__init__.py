"""The experiment infrastructure: the fairseq runner, progress lines, resumable study runs."""
