# The modern recipe at nanoGPT's "baby GPT" size (6 layers, 6 heads, 384 wide, 256 tokens of context:
# config/train_shakespeare_char.py's model), for a CPU: nanochat's / modded-nanogpt's architecture switches and
# Muon, with a schedule sized to about six minutes of training on a 2-core CPU with bf16 hardware (longer
# without: docs/RECIPES.md). nanoGPT's recipe for this model reaches val loss 1.47 after 5000 steps of 16,384
# tokens (82M tokens; minutes on a GPU, days on 2 cores).
#
#   gptforge prepare shakespeare_char
#   gptforge train config/speedrun_shakespeare_char_baby.py
#   gptforge bench config/speedrun_shakespeare_char_baby.py --target_loss=1.47 --eval_every=20
#
# Since 2026-11-27: NorMuon (normuon) and 400 steps instead of 440. On an Intel Xeon with AMX (2 cores, bf16), val
# 1.4590 / 1.4685 / 1.4686 at step 380 and 1.4551 / 1.4618 / 1.4637 at 400 for seeds 1337 / 1 / 2; plain Muon on
# the same 400 steps: 1.4703 / 1.4851 / 1.4776 and 1.4670 / 1.4755 / 1.4688 (docs/RECIPES.md, "NorMuon"). The
# figures below are plain Muon's, with 440 steps.
#
# Measured (docs/RECIPES.md): on a Zen 5 EPYC (AVX512-BF16, bf16 ~4x float32, 2 cores), this config reaches val
# 1.4660 on the whole val split at step 440 of 440 after 360.0, 361.2 and 372.2 s of training (three runs, 2.7M
# tokens); in float32 (--dtype=float32 --muon_dtype=float32) 1.4647 at step 440 after 1,251 s with torch's float32
# products, 1.4696 after 823 s with oneDNN's (onednn_f32, the default on such a CPU now), 1.4680 after 754 s with
# Muon's float32 iteration in its Gram form as well. The previous config
# (640 steps, dropout 0.05, Muon at 0.03, decay_frac 0.5) needed 560 steps there, 488-499 s; on an AVX2-only EPYC
# in float32, 3,291 s (54.9 minutes). Batch 24, no dropout, Muon at 0.05, the decay over the last 70% of 440 steps
# and the soft-cap at 30 come from sweeps run on a GPU (the same losses per step as a CPU, in seconds instead of
# minutes each).

out_dir = 'out-speedrun-shakespeare-char-baby'
eval_interval = 100
eval_iters = 20
log_interval = 5
always_save_checkpoint = False

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 24  # 6,144 tokens a step
block_size = 256

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.0  # under three epochs of 1M characters: no dropout (0.05 and 0.2 were slower to 1.47 here)
bias = False

rotary = True
rmsnorm = True
qk_norm = True
relu2 = True
untie_head = True
zero_init = True
logit_softcap = 30.0

optimizer = 'muon'
normuon = True  # each neuron's update normalised: 1.47 ~60 steps sooner than plain Muon (docs/RECIPES.md, "NorMuon")
muon_lr = 0.05
muon_warmup = 133
learning_rate = 3e-3
weight_decay = 0.0
beta2 = 0.99

lr_schedule = 'wsd'
decay_frac = 0.7
min_lr = 0.0
warmup_iters = 27
max_iters = 400
lr_decay_iters = 400

device = 'cpu'
compile = False
