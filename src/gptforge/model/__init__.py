"""The network and how its weights move: `gpt` (GPTConfig, GPT: embeddings, blocks, head, forward), `masks` (dropout
masks, drawn by the C kernel keep_mask.c where it builds), `native` (keep_mask.c built, loaded and checked against
`mask_reference`, the same arithmetic in torch operations and float64: its masks, RMSNorm, LayerNorm, residual and
softmax kernels), `layers`
(norms, rotary, dropout, the KV cache), `attention` and `head_loss` (CPU training's own kernels), `muon` (the Muon
optimizer) and `optim` (optimizer groups, the learning-rate schedule, the micro-steps of one update). Imports only
`core` and torch; generation lives in `infer`.

Importing it first calls each of oneMKL's vector math functions once on this thread (core/vml.py): their first
call on several threads at once can run a low-accuracy kernel, and every model computation comes after this."""

from gptforge.core.vml import warm_vml

warm_vml()
