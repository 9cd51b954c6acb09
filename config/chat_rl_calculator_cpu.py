# RL for the chat recipe with the calculator (docs/RECIPES.md#with-the-calculator-and-function-calling): arithmetic
# is already exact through the tool, so the steps go to the kinds the model must still answer by heart, counting
# (the weakest) most, with spelling and the system message beside it, and one function-calling problem a step
# (convert) so that its form is kept: RL without it broke the calls the model wrote (docs/RECIPES.md "One command").
# The engine runs any call the model writes while it samples (tools = 'calculator', the default); its output is
# never trained on. Each step samples 8 answers to each of 32 training problems; every 400 steps 7 held-out problems
# per entry of `kinds` are answered greedily. The last stage of `gptforge pipeline chat-cpu`.
#
#   gptforge rl config/chat_rl_calculator_cpu.py
#   gptforge eval chat --out_dir=out-chat-rl --kinds=count,spell,system,mul,add,sub,add3,recall,convert \
#       --examples=400 --seed=7

init_from = 'out-chat-sft'
out_dir = 'out-chat-rl'
kinds = (  # a step: count 19, spell 8, system 4, convert 1
    'count,spell,count,system,count,spell,count,count,count,spell,count,system,count,spell,count,convert'
    ',count,spell,count,system,count,spell,count,count,count,spell,count,system,count,spell,count,count'
)
tools = 'calculator'

max_steps = 1200
prompts_per_step = 32
num_generations = 8
max_completion_length = 96  # a function call, the model's answer after its output, the end token
temperature = 1.0

optimizer = 'muon'
muon_lr = 3e-3
learning_rate = 1.5e-4
lr_schedule = 'linear'

eval_interval = 400
eval_examples = 7
ckpt_interval = 400
