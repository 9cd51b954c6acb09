"""Evaluation: validation loss (loss.py), shared by training and `gptforge eval`; HellaSwag (hellaswag.py)."""
