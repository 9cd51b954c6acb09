# The "baby GPT": a character-level model of Tiny Shakespeare, nanoGPT's first example.
#   gptforge prepare shakespeare_char
#   gptforge train config/train_shakespeare_char.py            (on a GPU: ~3 minutes, val loss ~1.47)
#   gptforge sample --out_dir=out-shakespeare-char
# On a CPU, add --device=cpu (or --device=auto), or use config/train_shakespeare_char_cpu.py.

out_dir = 'out-shakespeare-char'
eval_interval = 250  # small data overfits quickly: watch val often
eval_iters = 200
log_interval = 10

# keep only the best model: on this small set val loss turns up once it starts to overfit
always_save_checkpoint = False

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # characters of context

# 6 layers, 6 heads, 384 wide: ~10.7M parameters
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # small models tolerate a higher rate
max_iters = 5000
lr_decay_iters = 5000  # usually equal to max_iters
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # a little higher, since there are few tokens per step

warmup_iters = 100
