"""LocalMultiheadAttention: each mechanism and their composition against references."""
