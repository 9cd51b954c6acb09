# The modern recipe at the README's CPU size: nanoGPT's README model (4 layers, 4 heads, 128 wide, 64 tokens of
# context) with nanochat's / modded-nanogpt's architecture switches and the Muon optimizer, tuned on a 2-core
# CPU for the least wall time to val loss 1.90 on Tiny Shakespeare's whole val split, a loss nanoGPT's README
# recipe (config/train_shakespeare_char_cpu.py) does not reach in its 2000 steps.
#
#   gptforge prepare shakespeare_char
#   gptforge train config/speedrun_shakespeare_char.py
#   gptforge bench config/speedrun_shakespeare_char.py --target_loss=1.90 --compare=config/train_shakespeare_char_cpu.py
#
# Batch 32, Muon at 0.02, AdamW at 3e-3 and the schedule come from a sweep of each setting; NorMuon reaches 1.90
# in fewer steps than plain Muon. What it reaches on each machine, and the sweep:
# docs/RECIPES.md#the-readme-cpu-size-val-loss-190

out_dir = 'out-speedrun-shakespeare-char'
eval_interval = 50
eval_iters = 20
log_interval = 10
always_save_checkpoint = False

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 32  # 2,048 tokens a step: Muon's per-step cost, the same at any batch, spread over more tokens than 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False

# the architecture switches (README, "The modern recipe's model switches")
rotary = True
rmsnorm = True
qk_norm = True
relu2 = True
untie_head = True
zero_init = True
logit_softcap = 15.0

# Muon for the blocks' matrices, AdamW (learning_rate) for the embedding and the head
optimizer = 'muon'
normuon = True  # each neuron's update normalised: 1.90 in fewer steps than plain Muon, over four seeds
muon_lr = 0.02
muon_warmup = 100  # momentum 0.85 -> 0.95 over the first 100 steps
learning_rate = 3e-3
weight_decay = 0.0
beta2 = 0.99

# warmup-stable-decay: 20 steps up, constant, then linear to 0 over the second half
lr_schedule = 'wsd'
decay_frac = 0.5
min_lr = 0.0
warmup_iters = 20
max_iters = 250
lr_decay_iters = 250

device = 'cpu'
compile = False
cpu_bf16_min_width = 128  # bf16 where its products are faster pays at this width too (docs/PERFORMANCE.md)
