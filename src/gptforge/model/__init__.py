"""The network and how its weights move: `gpt` (GPTConfig, GPT: embeddings, blocks, head, forward), `layers` (norms,
rotary, dropout, the KV cache), `muon` (the Muon optimizer) and `optim` (optimizer groups, the learning-rate
schedule, the micro-steps of one update). Imports only `core` and torch; generation lives in `infer`."""
