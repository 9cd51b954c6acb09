# GPT-2 (124M) on FineWeb-Edu, as build-nanogpt's train_gpt2.py trains it: one epoch of the 10B-token sample
# (sample-10BT) on one node of 8 GPUs (build-nanogpt used 8 x A100 80GB).
#
#   pip install 'gptforge[data]'
#   gptforge prepare fineweb_edu --val_tokens 100000000 --num_proc 8
#       -> data/fineweb_edu/: the first 100M tokens are val (build-nanogpt's shard 0), the rest train; ~20 GB
#   torchrun --standalone --nproc_per_node=8 -m gptforge train config/train_gpt2_fineweb.py
#
# Expected results (build-nanogpt's figures, not measured with gptforge on these machines): the val loss falls
# to about 3.29 by the end, 10B tokens (GPT-2 124M's own level on this validation data), and HellaSwag
# acc_norm approaches GPT-2 124M's 0.2955. Roughly 2 hours on 8 x A100 80GB by build-nanogpt's timing.
#
# Their flag names are ours too (--mini_batch_size is batch_size, --max_lr learning_rate, --warmup_steps
# warmup_iters, --eval_freq eval_interval, --logdir out_dir; `gptforge train --help` lists them), and the command
# line overrides this file under either name: `--mini_batch_size=32` or `--batch_size=32` (for GPUs with less
# memory: the gradient accumulation doubles, total_batch_size stays 2**19). Fewer GPUs (--nproc_per_node=1, 2
# or 4) accumulate more micro-batches: same tokens per step.

out_dir = 'log'  # build-nanogpt's log/: log.txt and model_05000.pt ... (plus ckpt.pt, metrics.jsonl, samples.jsonl)
dataset = 'fineweb_edu'  # read in order, shard after shard (data_loader 'auto' picks 'sharded' for shards)

# the model: 12 layers, 12 heads, 768 wide, 1024 tokens of context; the vocabulary comes from the dataset
# (GPT-2's 50,257 tokens, padded to 50,304 as build-nanogpt does)
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
bias = True  # GPT-2's Linear and LayerNorm biases, as in build-nanogpt's model
dropout = 0.0

# 2**19 = 524,288 tokens per optimizer step: 64 sequences x 1024 tokens x 8 micro-batches (one per GPU on 8)
total_batch_size = 2**19
batch_size = 64

# AdamW (betas 0.9 / 0.95, gradient clipping at 1.0: the defaults) and the schedule: linear warmup over 715
# steps (375M tokens, GPT-3's), then cosine decay to min_lr at the last step
learning_rate = 6e-4  # build-nanogpt's max_lr
min_lr = 6e-5
warmup_iters = 715
max_iters = 19073  # 19,073 x 524,288 = 10.0B tokens: one epoch of sample-10BT
lr_decay_iters = 19073
lr_schedule = 'cosine'
weight_decay = 0.1

# every 250 steps: val loss, HellaSwag (all 10,042 examples), 4 samples of "Hello, I'm a language model,"
eval_interval = 250
eval_iters = 160  # batches per split per evaluation, over all GPUs: build-nanogpt's 20 per GPU x 8
hellaswag_interval = 250
sample_interval = 250
log_interval = 1
# step checkpoints log/model_05000.pt, model_10000.pt, model_15000.pt and model_19072.pt (the last step);
# sample or evaluate one with --ckpt=log/model_05000.pt
ckpt_interval = 5000

device = 'cuda'
compile = True
dtype = 'bfloat16'
