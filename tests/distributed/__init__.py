"""fairseq's distributed training (two CPU ranks) with tied heads and gates."""
