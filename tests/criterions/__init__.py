"""The L0-regularised criterion: its penalty and how it is scaled."""
