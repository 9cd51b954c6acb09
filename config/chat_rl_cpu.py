# Step 4 of the chat recipe (docs/RECIPES.md#better-by-reward-rl): RL on the synthetic tasks SFT left weakest,
# from config/chat_sft_cpu.py's model. Each step samples 8 answers to each of 16 training problems, rewards the
# exact ones and takes a policy-gradient step on the answers' tokens; every 50 steps 100 held-out problems per kind
# are answered greedily (the rl_eval record).
#
#   gptforge rl config/chat_rl_cpu.py
#   gptforge eval chat --out_dir=out-chat-rl --kinds=count,sub,mul --examples=400 --seed=7 --tools=none

init_from = 'out-chat-sft'
out_dir = 'out-chat-rl'
kinds = 'count,sub,mul'  # the SFT model's weakest kinds without a calculator (docs/RECIPES.md)

max_steps = 600
prompts_per_step = 16
num_generations = 8
max_completion_length = 24  # the answers are a few digits and the end token
temperature = 1.0

learning_rate = 1e-4
lr_schedule = 'constant'

eval_interval = 50
eval_examples = 100
ckpt_interval = 50
