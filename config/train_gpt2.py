# GPT-2 124M on OpenWebText, as nanoGPT trains it: 8 GPUs (e.g. one 8 x A100 40GB node),
#   gptforge prepare openwebtext           (HF datasets; the shards take a while)
#   torchrun --standalone --nproc_per_node=8 -m gptforge train config/train_gpt2.py
# ~4 days on 8 x A100 to reach a val loss of ~2.85 (nanoGPT's figure; GPT-2 124M itself scores ~3.11 on OWT
# without fine-tuning).

wandb_log = True
wandb_project = 'owt'
wandb_run_name = 'gpt2-124M'

# tokens per step: 12 batch * 1024 block * 40 micro-batches (5 per GPU on 8 GPUs) = 491,520 (~0.5M)
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

# 600k steps of ~0.5M tokens: ~300B tokens in all
max_iters = 600000
lr_decay_iters = 600000

eval_interval = 1000
eval_iters = 200
log_interval = 10

weight_decay = 1e-1
