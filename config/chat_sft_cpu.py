# Step 3 of the chat recipe (docs/RECIPES.md#a-model-that-chats): supervised fine-tuning of
# config/chat_pretrain_cpu.py's model on the chit-chat conversations and the synthetic tasks, the loss on the
# assistant's tokens only, packed conversations kept apart. Each evaluation answers held-out synthetic problems
# greedily (the 'chat' record: exact match per task kind, and how many answers end with the end token).
#
#   gptforge train config/chat_sft_cpu.py
#   gptforge eval chat --out_dir=out-chat-sft --kinds=add3,recall --examples=200
#   gptforge chat --out_dir=out-chat-sft

out_dir = 'out-chat-sft'
init_from = 'out-chat-pretrain'  # the pretraining run's weights; the optimizer starts fresh
task = 'sft'
dataset = 'chat_sft'
eval_interval = 400
eval_iters = 20
log_interval = 20
chat_eval_examples = 80  # 10 per task kind at each evaluation
always_save_checkpoint = True  # the last step's model, whatever the val loss of 20 batches says
ckpt_interval = 400  # and model_NNNNN.pt every 400 steps, to compare runs step by step

gradient_accumulation_steps = 1
batch_size = 16  # rows of 256 tokens, about a third of them trained
block_size = 256

# the model's shape and switches come with the pretraining run's weights
dropout = 0.0

optimizer = 'muon'
muon_lr = 0.02
muon_warmup = 100
learning_rate = 2e-3
weight_decay = 0.0
beta2 = 0.99

lr_schedule = 'wsd'
decay_frac = 0.3
min_lr = 0.0
warmup_iters = 30
max_iters = 3600
lr_decay_iters = 3600

device = 'cpu'
compile = False
