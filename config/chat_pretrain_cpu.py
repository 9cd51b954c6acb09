# Step 2 of the chat recipe (docs/RECIPES.md#a-model-that-chats): pretrain a small modern GPT on Tiny
# Shakespeare + the chit-chat text, tokenized with the recipe's own 4,096-token BPE (digits one per token).
#
#   gptforge train config/chat_pretrain_cpu.py
#
# Then config/chat_sft_cpu.py teaches it to chat. Sized to about 8 minutes of a 2-core CPU with bf16 hardware.

out_dir = 'out-chat-pretrain'
eval_interval = 200
eval_iters = 20
log_interval = 20
always_save_checkpoint = False

dataset = 'chat_pretrain'
gradient_accumulation_steps = 1
batch_size = 16  # 4,096 tokens a step
block_size = 256

n_layer = 4
n_head = 4
n_embd = 256
dropout = 0.0
bias = False

rotary = True
rmsnorm = True
qk_norm = True
relu2 = True
untie_head = True
zero_init = True
logit_softcap = 30.0

optimizer = 'muon'
muon_lr = 0.03
muon_warmup = 100
learning_rate = 3e-3
weight_decay = 0.0
beta2 = 0.99

lr_schedule = 'wsd'
decay_frac = 0.3
min_lr = 0.0
warmup_iters = 30
max_iters = 600
lr_decay_iters = 600

device = 'cpu'
compile = False
