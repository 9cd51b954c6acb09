# RL for the chat recipe with the calculator (docs/RECIPES.md#with-the-calculator-and-function-calling): arithmetic
# is already exact through the tool, so the steps go to the kinds the model must still answer by heart, counting
# (the weakest) most, with spelling and the system message beside it. The engine runs any call the model writes
# while it samples (tools = 'calculator', the default); its output is never trained on. Each step samples 8 answers
# to each of 32 training problems; every 500 steps 25 held-out problems per entry of `kinds` are answered greedily.
# The last stage of `gptforge pipeline chat-cpu` (docs/RECIPES.md "One command" has its figures).
#
#   gptforge rl config/chat_rl_calculator_cpu.py
#   gptforge eval chat --out_dir=out-chat-rl --kinds=count,spell,system,mul,add,sub,add3,recall,convert \
#       --examples=400 --seed=7

init_from = 'out-chat-sft'
out_dir = 'out-chat-rl'
kinds = 'count,spell,count,system,count,spell,count,count'  # a step: count 20, spell 8, system 4
tools = 'calculator'

max_steps = 1800
prompts_per_step = 32
num_generations = 8
max_completion_length = 24  # a count or a spelt word and the end token (a call would not fit: it scores 0)
temperature = 1.0

optimizer = 'muon'
muon_lr = 3e-3
learning_rate = 1.5e-4
lr_schedule = 'linear'

eval_interval = 500
eval_examples = 25
ckpt_interval = 500
