"""Dataset preparation (prepare.py) and batch loading (loader.py)."""
