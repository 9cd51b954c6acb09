# Step 4 of the chat recipe (docs/RECIPES.md#better-by-reward-rl): RL from config/chat_sft_cpu.py's model on the
# kinds SFT left weak that sampling gets right often enough to learn from (count, sub, add), with the kinds it must
# keep at a small share so that they are not forgotten (spell, system, and multiplication, which half an hour of RL
# does not teach it). Each step samples 8 answers to each of 32 training problems, rewards the exact ones and takes
# a policy-gradient step on the answers' tokens; every 500 steps 13 held-out problems per entry of `kinds` are
# answered greedily (the rl_eval record). About half an hour on 2 cores (docs/RECIPES.md has the figures).
#
#   gptforge rl config/chat_rl_cpu.py
#   gptforge eval chat --out_dir=out-chat-rl --kinds=count,sub,add,mul,add3,spell,recall,system --examples=400 \
#       --seed=7 --tools=none

init_from = 'out-chat-sft'
out_dir = 'out-chat-rl'
kinds = (  # a step of 32 problems: add 13, sub 8, count 6, spell 2, system 2, mul 1 (kept, not drilled)
    'add,sub,add,count,add,sub,add,spell,add,sub,count,add,sub,add,count,system,'
    'add,sub,add,count,add,sub,mul,spell,add,sub,count,add,sub,add,count,system'
)

max_steps = 1800
prompts_per_step = 32
num_generations = 8
max_completion_length = 24  # the answers are a few digits, or a spelt word, and the end token
temperature = 1.0
tools = 'none'  # the recipe's model has no tools (its evaluations: --tools=none)

optimizer = 'muon'  # the blocks' matrices by Muon, as nanochat's RL; AdamW for the rest
muon_lr = 3e-3
learning_rate = 1.5e-4
lr_schedule = 'linear'

eval_interval = 500
eval_examples = 13  # per entry of kinds: 416 problems
ckpt_interval = 500
