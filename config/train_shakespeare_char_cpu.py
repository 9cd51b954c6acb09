# nanoGPT's README command for a CPU (a laptop, or this project's 2-core test machine), as a config file:
#   python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
#       --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
#       --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
# is the same as
#   gptforge train config/train_shakespeare_char_cpu.py
# A 0.8M-parameter model; 2000 steps take a minute or two on 2 cores and reach val loss ~1.88.

out_dir = 'out-shakespeare-char'
eval_interval = 250
eval_iters = 20  # 20 batches per split: a noisier figure, but evaluation stays cheap on a CPU
log_interval = 1
always_save_checkpoint = False

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0  # too small a model and too short a run to overfit

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100

device = 'cpu'
compile = False
