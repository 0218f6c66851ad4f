"""The recipe driver: every recipe's configuration, dry runs, and a tiny run end to end."""
