# Fine-tune OpenAI's GPT-2 (124M) on Tiny Shakespeare, GPT-2 BPE (nanoGPT's finetune_shakespeare.py, with the
# smallest GPT-2 so that it fits a laptop; nanoGPT uses gpt2-xl on a GPU):
#   pip install 'gptforge[hf]'
#   gptforge prepare shakespeare
#   gptforge train config/finetune_shakespeare.py            (add --device=cpu on a machine without a GPU)
#   gptforge sample --out_dir=out-shakespeare --start="ROMEO:"
# Offline, download the model folder elsewhere and pass --init_from=/path/to/gpt2 (config.json + model.safetensors).

out_dir = 'out-shakespeare'
eval_interval = 5
eval_iters = 40
wandb_log = False
wandb_project = 'shakespeare'
wandb_run_name = 'ft-gpt2'

dataset = 'shakespeare'
init_from = 'gpt2'  # or 'gpt2-medium', 'gpt2-large', 'gpt2-xl', or a local folder

# only save when val improves: a few hundred thousand tokens overfit a 124M model quickly
always_save_checkpoint = False

# 1 sequence x 32 micro-steps x 1024 tokens = 32,768 tokens per step; the set is ~301k tokens: 1 epoch ~ 9 steps
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

# fine-tune at a small constant learning rate
learning_rate = 3e-5
decay_lr = False
