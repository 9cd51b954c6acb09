# The modern recipe at the README's CPU size: nanoGPT's README model (4 layers, 4 heads, 128 wide, 64 tokens of
# context) with nanochat's / modded-nanogpt's architecture switches and the Muon optimizer, tuned on a 2-core
# CPU for the least wall time to val loss 1.90 on Tiny Shakespeare (docs/RECIPES.md has the sweeps).
#
#   gptforge prepare shakespeare_char
#   gptforge train config/speedrun_shakespeare_char.py
#   gptforge bench config/speedrun_shakespeare_char.py --target_loss=1.90 --compare=config/train_shakespeare_char_cpu.py
#
# Measured (docs/RECIPES.md, a 2-core AMD EPYC without bf16 hardware): val loss 1.90 on the whole val split
# after 158 steps, 35.7 s of training; nanoGPT's recipe (config/train_shakespeare_char_cpu.py) ends its 2000
# steps (143.7 s) at 1.905 on the same tokens. With AVX512-BF16 (an AMD EPYC, bf16 autocast from 128 wide, below):
# 1.8933 at step 158 after 11.8 s, against nanoGPT's recipe's 85.8 s without reaching it. Those figures are plain
# Muon's; with NorMuon (normuon, on since 2026-11-27), on an Intel Xeon with AMX: 1.90 at steps 148 / 146 / 142 /
# 154 for seeds 1337 / 1 / 2 / 3 (plain Muon: 158 / 158 / 158 / 164), 8.3 s of training (median; 9.0 s).

out_dir = 'out-speedrun-shakespeare-char'
eval_interval = 50
eval_iters = 20
log_interval = 10
always_save_checkpoint = False

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 32  # 2,048 tokens a step: Muon's per-step cost (~30 ms here) is spread over more tokens than 12
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
normuon = True  # each neuron's update normalised: 1.90 in a median 147 steps instead of 158 (docs/RECIPES.md)
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
cpu_bf16_min_width = 128  # bf16 where the CPU has it: 1.5x a step at this width (docs/PERFORMANCE.md)
