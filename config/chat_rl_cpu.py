# Step 4 of the chat recipe (docs/RECIPES.md#better-by-reward-rl): RL on the synthetic tasks SFT left weakest
# without a calculator, from config/chat_sft_cpu.py's model. Each step samples 8 answers to each of 32 training
# problems, rewards the exact ones and takes a policy-gradient step on the answers' tokens; every 250 steps 100
# held-out problems per kind are answered greedily (the rl_eval record). About half an hour on 2 cores.
#
#   gptforge rl config/chat_rl_cpu.py
#   gptforge eval chat --out_dir=out-chat-rl --kinds=count,sub,mul --examples=400 --seed=7 --tools=none

init_from = 'out-chat-sft'
out_dir = 'out-chat-rl'
kinds = 'count,sub,mul'  # the SFT model's weakest kinds without a calculator (docs/RECIPES.md)

max_steps = 2800
prompts_per_step = 32
num_generations = 8
max_completion_length = 24  # the answers are a few digits and the end token
temperature = 1.0

optimizer = 'muon'  # the blocks' matrices by Muon, as nanochat's RL; AdamW for the rest
muon_lr = 2e-3
learning_rate = 1e-4
lr_schedule = 'linear'

eval_interval = 250
eval_examples = 100
ckpt_interval = 250
