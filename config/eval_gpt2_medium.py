# Evaluate OpenAI's gpt2-medium on OpenWebText: loss only, no training (nanoGPT's eval_gpt2_medium.py).
#   gptforge prepare openwebtext
#   gptforge train config/eval_gpt2_medium.py
# nanoGPT reports, for OpenAI's GPT-2 family on OpenWebText (train / val loss):
#   gpt2 3.11 / 3.12, gpt2-medium 2.85 / 2.84, gpt2-large 2.66 / 2.67, gpt2-xl 2.56 / 2.54
batch_size = 8
eval_iters = 500  # more batches: a steadier figure
eval_only = True
wandb_log = False
init_from = 'gpt2-medium'
