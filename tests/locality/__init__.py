"""The mechanisms' maths (locality/), each against a direct formula from its paper."""
