"""The data preparation, the demos and the study through the commands users run."""
