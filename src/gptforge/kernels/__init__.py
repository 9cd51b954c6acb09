"""The speed paths, behind plain tensor functions that choose their own: `dropout` (dropout and residual sums with
it), `norms` (LayerNorm, RMSNorm), `rotary`, `linear`, `activations` (relu2), `attention` (the head split and
attention: SDPA or gptforge's own) and `head_loss` (the training loss from the hidden states). Each takes a compiled
CPU kernel (`cpu_kernels.c`, built, loaded and checked by `native` and `checks` against `reference`, the same
arithmetic in torch operations and float64), a layout for torch.compile, or torch's own operations. `masks` draws
dropout masks. The network that calls them is `model`.

Importing it first calls each of oneMKL's vector math functions once on this thread (core/vml.py): their first
call on several threads at once can run a low-accuracy kernel, and every computation here comes after this.
Imports: core."""

from gptforge.core.vml import warm_vml

warm_vml()
