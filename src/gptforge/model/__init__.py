"""The network and how its weights move: `gpt` (GPTConfig, GPT: embeddings, blocks, head, forward), `masks` (dropout
masks, drawn by the C kernel keep_mask.c where it builds; the same file's RMSNorm and softmax kernels), `layers`
(norms, rotary, dropout, the KV cache), `attention` and `head_loss` (CPU training's own kernels), `muon` (the Muon
optimizer) and `optim` (optimizer groups, the learning-rate schedule, the micro-steps of one update). Imports only
`core` and torch; generation lives in `infer`."""
