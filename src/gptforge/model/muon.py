"""Muon for the hidden 2-D matrices, AdamW for everything else, in one torch optimizer.

Muon (Keller Jordan, 2024; the modded-nanogpt speedrun and nanochat train with it): keep a momentum of the
gradient, then replace it by the nearest semi-orthogonal matrix (its polar factor U V^T, computed approximately
by a Newton-Schulz iteration instead of an SVD) and step along that. Every direction of the update gets the
same size, so rare directions learn as fast as common ones. Embeddings, the output head and the gains are
not matrices in that sense and keep AdamW.

One optimizer class holding both kinds of parameter group keeps everything that works on a torch optimizer
working: the lr schedule (each group scaled by its `lr_scale`), GradScaler, gradient clipping, and the
checkpoint (`state_dict` holds both momenta and both step counts, so a resumed run continues bit for bit).
Under DDP every rank holds the same averaged gradient, so every rank computes the same update. Under FSDP each
rank holds a shard of each matrix: its update is computed on the whole matrix (`_orthogonalize_whole`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

from gptforge.model.eager_optim import EagerMethods

# Newton-Schulz: X <- a X + (b A + c A^2) X with A = X X^T. These coefficients (from the Muon write-up) push
# every singular value of a matrix scaled to norm <= 1 into roughly [0.7, 1.2] in five steps: not exactly 1,
# which is what makes the iteration this fast, and what Muon needs.
QUINTIC = (3.4445, -4.7750, 2.0315)
CUBIC = (1.5, -0.5, 0.0)  # the classic iteration: converges to the polar factor itself, only more slowly


def orthogonalize(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = QUINTIC,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """An approximation of the polar factor U V^T of a 2-D matrix g = U S V^T, or of each matrix of a stack
    [k, m, n] (one batched product per iteration), by `steps` Newton-Schulz steps computed in `dtype` (default g's:
    float32 or float64; bfloat16 where the hardware has it, as modded-nanogpt does). Returned in that dtype."""
    a, b, c = coefficients
    wide = g.size(-2) > g.size(-1)
    x = g.mT if wide else g  # iterate on the side with the smaller Gram matrix
    norm = x.norm(dim=(-2, -1), keepdim=True, dtype=torch.float32 if dtype == torch.bfloat16 else None)
    x = (x / (norm + 1e-7)).to(dtype or g.dtype)  # Frobenius norm >= spectral norm: every singular value now <= 1
    fma = torch.baddbmm if x.dim() == 3 else torch.addmm  # beta * input + alpha * (m1 @ m2), one pass
    if gram_form_pays(x):
        x = _gram_form(x, steps, (a, b, c), fma)
    else:
        for _ in range(steps):
            gram = x @ x.mT
            x = fma(x, fma(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if wide else x


def gram_form_pays(x: torch.Tensor) -> bool:
    """Whether orthogonalize takes the Gram form for x (m x n after the turn, m <= n): at n >= 2m (a 384 x 1536
    matrix: 0.55x the multiply-adds in five steps), on a CPU, in float64 or in float32 whose products are float32
    (not lowered by set_float32_matmul_precision): within ~3e-4 (relative) of the step-by-step result in float32,
    where bfloat16's step-by-step result is within ~0.1. Not in bfloat16: its m x m products keep their rounding
    errors, the singular values reach 2.5 instead of ~1.2; started again from X every three steps it stays near 1
    but trained worse (docs/lab/2026-11-26-zen5.md). Not on CUDA (TF32 float32 products; not measured there)."""
    if x.size(-1) < 2 * x.size(-2) or x.device.type != "cpu":
        return False
    return x.dtype == torch.float64 or (x.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest")


def _gram_form(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float], fma) -> torch.Tensor:  # noqa: ANN001
    """The same iteration on the m x m side: every X_k is Q_k X_0 with Q_k a polynomial of the Gram matrix
    G = X_0 X_0^T, and A_k = X_k X_k^T = Q_k G Q_k. One step is P = a + b A + c A^2 (one product), Q <- P Q and
    A <- P A P (three): 4 m^3 multiply-adds instead of 2 m^2 n + m^3, and two m^2 n products in all (G, and Q X_0
    at the end). For a 384 x 1536 matrix in five steps: 0.55x the multiply-adds (the first step has no Q, the
    last no A). Equal to the step-by-step form in exact arithmetic (gram_form_pays says where it is used)."""
    a, b, c = coefficients
    A = x @ x.mT
    Q = None
    for i in range(steps):
        P = fma(A, A, A, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else P @ Q
        if i < steps - 1:
            A = (P @ A) @ P
    return x if Q is None else Q @ x


NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MuonAdamW(EagerMethods, torch.optim.Optimizer):
    """Parameter groups with kind='muon' (2-D matrices) or kind='adamw'. Muon groups: lr, momentum (Nesterov),
    momentum_warmup (steps over which momentum rises from 0.85 to its value), weight_decay, ns_steps, and
    row_blocks (optional, one int per parameter: a matrix of k row blocks is orthogonalised as k matrices, each
    scaled as its own; 3 for a fused query/key/value matrix, as modded-nanogpt keeps them apart), and
    normuon_beta2 (optional: NorMuon's per-neuron normalisation of the update, normalize_neurons). AdamW groups:
    lr, betas, eps, weight_decay (decoupled, as torch.optim.AdamW)."""

    def __init__(self, groups: Iterable[dict[str, Any]]):
        defaults = dict(
            kind="adamw",
            lr=1e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.0,
            momentum=0.95,
            momentum_warmup=300,
            ns_steps=5,
            lr_scale=1.0,
        )
        super().__init__(list(groups), defaults)
        for group in self.param_groups:
            if group["kind"] == "muon" and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D matrices only")
            blocks = group.get("row_blocks")
            if blocks is not None and (
                len(blocks) != len(group["params"])
                or any(p.size(0) % k for p, k in zip(group["params"], blocks, strict=True))
            ):
                raise ValueError("row_blocks: one count per parameter, each dividing its matrix's rows")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    if group["kind"] == "adamw":
                        state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if group["kind"] != "muon":
                    self._adamw(p, state, group)
            if group["kind"] == "muon" and params:
                self._muon(params, group)
        return loss

    def _muon(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """The Nesterov momentum of each matrix (or of each of its row blocks), orthogonalised (matrices of one
        shape together, in one stack), scaled to the same update RMS for tall and wide matrices, and stepped along."""
        ns_dtype = NS_DTYPES[group.get("ns_dtype", "float32")]  # a checkpoint's group from before the key: float32
        beta2 = group.get("normuon_beta2")
        blocks = dict(zip(map(id, group["params"]), group.get("row_blocks") or [1] * len(group["params"]), strict=True))
        by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, float, int]]] = {}
        for p in params:
            momentum = _momentum(self.state[p]["step"].item(), group)
            buf = self.state[p]["exp_avg"]
            buf.mul_(momentum).add_(p.grad)
            k = blocks[id(p)]
            if beta2 is None:
                self.state[p].pop(NEURON_STATE, None)  # a run resumed without normuon: no stale statistics kept
            if hasattr(buf, "full_tensor"):  # FSDP: a shard of the matrix on each rank
                direction = p.grad.add(buf, alpha=momentum)  # Nesterov: the gradient plus the momentum it leads to
                neurons = None
                if beta2 is not None:  # the whole update's neurons, this matrix's statistics
                    neurons = partial(normalize_neurons, states=[self.state[p]], blocks=[k], beta2=beta2)
                self._apply(p, _orthogonalize_whole(direction, group["ns_steps"], ns_dtype, k, neurons), group, k)
            else:
                by_shape.setdefault((p.size(0) // k, p.size(1)), []).append((p, momentum, k))
        for shape, entries in by_shape.items():
            # each direction written straight into its place in the stack (float32), one pass instead of three;
            # a matrix of k row blocks takes k places, its rows in order
            stack = torch.empty(sum(k for *_, k in entries), *shape, dtype=torch.float32, device=entries[0][0].device)
            at = 0
            for p, momentum, k in entries:  # Nesterov: the gradient plus the momentum it leads to
                place = stack[at : at + k].view(p.shape)
                if p.grad.dtype == torch.float32:
                    torch.add(p.grad, self.state[p]["exp_avg"], alpha=momentum, out=place)
                else:  # summed in the gradient's dtype, then widened
                    place.copy_(p.grad.add(self.state[p]["exp_avg"], alpha=momentum))
                at += k
            updates = orthogonalize(stack if len(stack) > 1 else stack[0], group["ns_steps"], dtype=ns_dtype)
            updates = updates if len(stack) > 1 else updates.unsqueeze(0)  # a tall one comes back transposed
            if beta2 is not None:
                normalize_neurons(updates, [self.state[p] for p, *_ in entries], [k for *_, k in entries], beta2)
            at = 0
            for p, _, k in entries:
                self._apply(p, updates[at] if k == 1 else updates[at : at + k].reshape(p.shape), group, k)
                at += k

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, group: dict[str, Any], row_blocks: int = 1) -> None:
        # the same update RMS for tall and wide matrices of the same size (each row block a matrix of its own)
        scale = max(1.0, p.size(0) / row_blocks / p.size(1)) ** 0.5
        if group["weight_decay"]:  # a product by 1 changes nothing: not a pass over p
            p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)

    @staticmethod
    def _adamw(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        step = state["step"].item()
        state["exp_avg"].lerp_(p.grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
        if group["weight_decay"]:
            p.mul_(1.0 - group["lr"] * group["weight_decay"])
        denom = (state["exp_avg_sq"] / (1.0 - beta2**step)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1.0 - beta1**step))


NEURON_STATE = "neuron_sq"  # normuon: a matrix's running mean of each neuron's squared update entries


def normalize_neurons(updates: torch.Tensor, states: list[dict[str, Any]], blocks: list[int], beta2: float) -> None:
    """NorMuon (Li et al. 2025, "NorMuon: making Muon more efficient and scalable"; modded-nanogpt trains with it):
    Muon's orthogonalised update evens out the singular values but leaves the neurons' update sizes uneven. Each
    neuron's entries are divided by the root of a running mean (beta2) of its squared entries, then the matrix is
    scaled back to the Frobenius norm it had, so muon_lr keeps its meaning. A neuron is a row of a matrix at least
    as tall as it is wide and a column of a wider one: the longer side, whose sizes orthogonalisation leaves uneven
    (a wide matrix's rows come out of it of norm ~1 each).

    updates: a stack (K, r, c) in place, K the sum of `blocks`; matrix i takes blocks[i] consecutive places (its row
    blocks, row_blocks) and keeps its statistics in states[i] (float32, one per neuron, saved with the optimizer).
    The statistics start at zero: a uniform factor, which the rescaling cancels, so no bias correction is needed."""
    dim = -1 if updates.size(-2) >= updates.size(-1) else -2  # reduce along each neuron's entries
    means = torch.linalg.vector_norm(updates, dim=dim, dtype=torch.float32).square_().div_(updates.size(dim))
    factors = torch.empty_like(means)
    at = 0
    for state, k in zip(states, blocks, strict=True):
        mean = means[at : at + k].reshape(-1)  # the matrix's neurons, block after block
        running = state.get(NEURON_STATE)
        if running is None or running.shape != mean.shape:  # new, or resumed across a change of muon_split_qkv
            running = state[NEURON_STATE] = torch.zeros_like(mean)
        running.lerp_(mean, 1.0 - beta2)
        inverse = running.sqrt().add_(1e-12).reciprocal_()
        # the same Frobenius norm after as before (an all-zero update, as zero_init's first steps give, stays zero)
        rescale = (mean.sum() / (inverse.square() * mean).sum().clamp_min(1e-30)).sqrt()
        factors[at : at + k] = (inverse * rescale).view(k, -1)
        at += k
    updates.mul_(factors.unsqueeze(dim).to(updates.dtype))


def _momentum(step: float, group: dict[str, Any]) -> float:
    """Muon's momentum at a step: rising from 0.85 to the group's over momentum_warmup steps (when above 0.85)."""
    if group["momentum"] <= 0.85:
        return group["momentum"]
    warm = min(step / max(group["momentum_warmup"], 1), 1.0)
    return 0.85 + warm * (group["momentum"] - 0.85)


def _orthogonalize_whole(
    direction: torch.Tensor,
    steps: int,
    dtype: torch.dtype,
    row_blocks: int = 1,
    neurons: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Muon's update of a sharded matrix (an FSDP2 DTensor): every rank gathers the whole matrix, orthogonalises
    it (the same arithmetic on every rank, so the same result) and keeps its own shard, as a DTensor placed
    like the parameter. The same update as one process computes, at the price of an all-gather per matrix and
    each rank repeating the iteration. neurons: normalize_neurons on the whole update's stack (normuon), whose
    statistics every rank keeps whole (the same on every rank)."""
    from torch.distributed.tensor import distribute_tensor

    whole = direction.full_tensor().float()
    blocks = whole.view(row_blocks, whole.size(0) // row_blocks, whole.size(1))  # each row block a matrix of its own
    updates = orthogonalize(blocks if row_blocks > 1 else blocks[0], steps, dtype=dtype)
    updates = updates if row_blocks > 1 else updates.unsqueeze(0)
    if neurons is not None:
        neurons(updates)
    whole = updates.reshape(whole.shape).to(direction.dtype)
    # src_data_rank=None: each rank slices its own copy (all equal), no scatter from rank 0
    return distribute_tensor(whole, direction.device_mesh, direction.placements, src_data_rank=None)
