"""The network and how its weights move: `gpt` (GPTConfig, GPT: embeddings, blocks, head, forward, one forward per
module), `modules` (its Linear, norms, activation and dropout, each a call of a `kernels` function), `cache` (the
KV cache, eval mode for a while), `vocab` (a vocabulary grown), `eager_optim`, `muon` (the Muon optimizer) and
`optim` (optimizer groups, the micro-steps of one update). Generation lives in `infer`.

Importing it first calls each of oneMKL's vector math functions once on this thread (core/vml.py): their first
call on several threads at once can run a low-accuracy kernel, and every model computation comes after this.
Imports: core, kernels."""

from gptforge.core.vml import warm_vml

warm_vml()
