"""`gptforge rl`'s arithmetic against hand computations, what carries gradient, a bandit whose best answer is known,
and its settings read like training's."""

from __future__ import annotations

import math

import pytest
import torch

from chat_tools import tiny_model
from gptforge.core.config_file import load_settings
from gptforge.core.errors import UserError
from gptforge.rl.objective import STD_EPS, answer_logprobs, group_advantages, groups_logprobs, policy_loss
from gptforge.rl.options import RLConfig
from gptforge.rl.rollout import Group, sample_groups
from rl_reference import sample_group


def test_advantages_are_reward_minus_the_group_mean_and_optionally_over_its_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    plain = group_advantages(rewards, 4, scale=False)
    assert plain.tolist() == [0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75]
    scaled = group_advantages(rewards, 4, scale=True)
    std_a, std_b = math.sqrt(1 / 3), math.sqrt(0.25)  # the unbiased standard deviations of the two groups
    expected = [0.5 / (std_a + STD_EPS)] * 1 + [-0.5 / (std_a + STD_EPS)] * 2 + [0.5 / (std_a + STD_EPS)]
    expected += [-0.25 / (std_b + STD_EPS)] * 3 + [0.75 / (std_b + STD_EPS)]
    assert scaled.tolist() == pytest.approx(expected, rel=1e-6)
    assert group_advantages(torch.ones(4), 4, scale=True).tolist() == [0.0] * 4  # no signal, no division by zero


def test_the_loss_per_token_against_a_hand_computation():
    f64 = {"dtype": torch.float64}
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]], **f64)
    old = torch.tensor([[-1.1, -1.5, -0.5], [-0.3, -0.6, -4.0]], **f64)
    ref = torch.tensor([[-0.9, -2.0, -0.7], [-0.2, -0.1, -3.0]], **f64)
    weights = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], **f64)  # the last token of row 2 is padding
    advantages = torch.tensor([0.5, -1.0], **f64)
    eps, beta, total = 0.2, 0.1, 10.0  # total: the whole batch's tokens, of which these are 5
    loss, kl = policy_loss(logp, old, advantages, weights, total, eps, ref, beta)
    expected, expected_kl = 0.0, 0.0
    for i in range(2):
        for t in range(3):
            if not weights[i, t]:
                continue
            ratio = math.exp(logp[i, t] - old[i, t])
            a = float(advantages[i])
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            d = float(ref[i, t] - logp[i, t])
            k3 = math.exp(d) - d - 1
            expected += -min(ratio * a, clipped * a) + beta * k3
            expected_kl += k3
    assert float(loss) == pytest.approx(expected / total, rel=1e-12)
    assert float(kl) == pytest.approx(expected_kl, rel=1e-12)


def test_one_pass_gradient_is_the_advantage_times_the_log_probability_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([0.7]), torch.ones(1, 2), 4.0, 0.2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.7 / 4, -0.7 / 4])


def _group(model, prompt, answers, lengths):
    tokens = torch.tensor(answers)
    weights = torch.tensor([[1.0 if t < n else 0.0 for t in range(tokens.size(1))] for n in lengths])
    return Group(prompt, tokens, weights, torch.tensor([n < tokens.size(1) for n in lengths]))


def _grads(model, group, advantages):
    model.zero_grad(set_to_none=True)
    logp = answer_logprobs(model, group.sequences, len(group.prompt), group.tokens.size(1))
    loss, _ = policy_loss(logp, logp.detach(), advantages, group.weights, float(group.weights.sum()), 0.2)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, loss.item()


def test_only_the_generated_tokens_carry_gradient_and_the_loss_matches_float64():
    model = tiny_model(vocab_size=64, block_size=32, seed=3).double()
    prompt = [5, 9, 2, 7]
    answers = [[3, 4, 63, 0], [8, 63, 0, 0]]  # 63 ends an answer; what follows is padding
    group = _group(model, prompt, answers, [3, 2])
    advantages = torch.tensor([0.5, -0.5], dtype=torch.float64)
    grads, loss = _grads(model, group, advantages)
    # by hand: the full sequence's log-softmax, the answer tokens' entries, weighted by advantage over 5 tokens
    model.zero_grad(set_to_none=True)
    full = torch.log_softmax(model.logits(model.hidden_states(group.sequences[:, :-1])), dim=-1)
    surrogate = 0.0
    for row, n in enumerate([3, 2]):
        for t in range(n):
            surrogate = surrogate - advantages[row] * full[row, len(prompt) - 1 + t, answers[row][t]]
    (surrogate / 5).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-6, atol=1e-8), name  # float64, some kernels float32 inside
    assert loss == pytest.approx(-(0.5 * 3 - 0.5 * 2) / 5)  # at ratio 1 the loss is -mean(advantage) per token
    # padding after an answer's end is never scored: other padding tokens, the same gradient
    padded = _group(model, prompt, [[3, 4, 63, 17], [8, 63, 40, 41]], [3, 2])
    same, _ = _grads(model, padded, advantages)
    assert all(torch.equal(grads[n], same[n]) for n in grads)
    # a generated token's weight does change it
    heavier = _group(model, prompt, answers, [3, 2])
    heavier.weights[0, 1] = 2.0
    other, _ = _grads(model, heavier, advantages)
    assert any(not torch.equal(grads[n], other[n]) for n in grads)


def test_a_bandit_learns_its_best_arm():
    """One prompt, one-token answers, reward 1 for token 7: the policy puts most of its probability there."""
    model = tiny_model(vocab_size=16, block_size=16, seed=1).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    prompt, best = [1, 2, 3], 7
    for step in range(40):
        generator = torch.Generator().manual_seed(step)
        (group,) = sample_groups(model, [prompt], 16, 1, 15, [generator])
        rewards = (group.tokens[:, 0] == best).float()
        advantages = group_advantages(rewards, 16, scale=False)
        logp = answer_logprobs(model, group.sequences, len(prompt), 1)
        loss, _ = policy_loss(logp, logp.detach(), advantages, group.weights, float(group.weights.sum()), 0.2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        probs = torch.softmax(model.logits(model.hidden_states(torch.tensor([prompt])))[0, -1], dim=-1)
    assert float(probs[best]) > 0.9, probs


def test_a_group_stops_at_the_end_token_and_weights_what_was_written():
    model = tiny_model(vocab_size=16, block_size=16, seed=2)
    (group,) = sample_groups(model, [[1, 2]], 8, 6, 3, [torch.Generator().manual_seed(0)])
    for row in range(8):
        tokens, weights = group.tokens[row].tolist(), group.weights[row].tolist()
        n = int(sum(weights))
        assert weights == [1.0] * n + [0.0] * (len(tokens) - n)
        if group.ended[row]:
            assert tokens[n - 1] == 3 and 3 not in tokens[: n - 1] and all(t == 3 for t in tokens[n:])
        else:
            assert n == len(tokens) == 6 and 3 not in tokens
        assert group.answer(row) == tokens[: n - int(group.ended[row])]


def test_sampling_is_the_same_for_the_same_generator_seed():
    model = tiny_model(vocab_size=16, block_size=16, seed=2)
    a, b = (sample_groups(model, [[1, 2]], 4, 5, 3, [torch.Generator().manual_seed(5)], 0.8)[0] for _ in range(2))
    assert torch.equal(a.tokens, b.tokens)


def test_settings_read_like_trainings(tmp_path):
    config = tmp_path / "rl.py"
    config.write_text("init_from = 'out-chat-sft'\nnum_generations = 4\ntemperature = 0.5 * 2\n")
    cfg = load_settings(RLConfig, [str(config), "--num_generations", "6", "--kinds=count"], "rl")
    assert (cfg.init_from, cfg.num_generations, cfg.temperature, cfg.kinds) == ("out-chat-sft", 6, 1.0, "count")
    with pytest.raises(UserError, match=r"rl.py:2: unknown key 'num_generation'; did you mean num_generations"):
        config.write_text("init_from = 'x'\nnum_generation = 4\n")
        load_settings(RLConfig, [str(config)], "rl")
    with pytest.raises(UserError, match="--num_generations must be at least 2"):
        load_settings(RLConfig, ["--init_from=x", "--num_generations=1"], "rl")
    with pytest.raises(UserError, match="needs --init_from"):
        load_settings(RLConfig, [], "rl")
    with pytest.raises(UserError, match="--kinds must be comma-separated synthetic task kinds"):
        load_settings(RLConfig, ["--init_from=x", "--kinds=count,sing"], "rl")
    with pytest.raises(UserError, match="--temperature: temperature must be float"):
        load_settings(RLConfig, ["--init_from=x", "--temperature=hot"], "rl")


def test_groups_stepped_together_sample_what_each_group_alone_samples():
    """sample_groups batches the rows of several prompts of different lengths (each at its own position); with
    the same generators every group's answers are sample_group's (float64: no rounding decides a draw)."""
    model = tiny_model(vocab_size=8, block_size=48, seed=4, rotary=True).double()
    prompts = [[1, 2, 3], [4, 5, 6, 1, 2, 3], [6], [2, 2]]
    seeds = [11, 12, 13, 14]
    together = sample_groups(model, prompts, 4, 30, 7, [torch.Generator().manual_seed(s) for s in seeds])
    assert len({g.tokens.size(1) for g in together}) > 1  # groups ended at different steps and left the batch
    for prompt, seed, got in zip(prompts, seeds, together, strict=True):
        alone = sample_group(model, prompt, 4, 30, 7, torch.Generator().manual_seed(seed))
        assert torch.equal(got.tokens, alone.tokens) and torch.equal(got.weights, alone.weights)
        assert torch.equal(got.ended, alone.ended)


@pytest.mark.parametrize("switches", [{"rotary": True}, {}], ids=["rotary", "learned positions"])
def test_groups_scored_together_with_each_prompt_run_once_equal_the_whole_sequences(switches):
    """groups_logprobs (prompts of different lengths as one batch, each run once, its keys and values shared by
    its group's answers) gives answer_logprobs' values on every answer token and the same gradient (float64), the
    prompts' tokens included through the answers' attention."""
    model = tiny_model(vocab_size=16, block_size=48, seed=5, **switches).double()
    prompts = [[4, 5, 6, 7, 8, 9, 10], [1, 2], [3, 3, 3, 3]]
    groups = sample_groups(model, prompts, 4, 10, 15, [torch.Generator().manual_seed(s) for s in (2, 3, 4)])
    full = _scored(
        model, groups, lambda: [answer_logprobs(model, g.sequences, len(g.prompt), g.tokens.size(1)) for g in groups]
    )
    shared = _scored(model, groups, lambda: groups_logprobs(model, prompts, [g.tokens for g in groups]))
    for x, y, g in zip(full[0], shared[0], groups, strict=True):
        assert torch.allclose(x * g.weights, y * g.weights, rtol=1e-10, atol=1e-12)
    for name, grad in full[1].items():
        assert torch.allclose(grad, shared[1][name], rtol=1e-6, atol=1e-8), name


def _scored(model, groups, score):
    """(the answers' log-probabilities, the gradient of their policy loss) with `score` computing them."""
    model.zero_grad(set_to_none=True)
    logps = score()
    advantages = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    total = float(sum(g.weights.sum() for g in groups))
    loss = sum(
        policy_loss(lp, lp.detach(), advantages, g.weights, total, 0.2)[0] for lp, g in zip(logps, groups, strict=True)
    )
    loss.backward()
    return [lp.detach() for lp in logps], {n: p.grad.clone() for n, p in model.named_parameters()}


def test_update_passes_group_answers_of_like_width_and_give_the_one_pass_gradient():
    """length_chunks: every group once, by width, at most `per` a pass, no pass holding answers more than twice
    as wide as its narrowest; the gradient summed over those passes equals the one pass over all groups
    (float64)."""
    from gptforge.rl.loop import length_chunks

    widths = [3, 20, 4, 9, 3, 18, 5, 2]
    chunks = length_chunks(widths, per=3)
    assert sorted(i for c in chunks for i in c) == list(range(8))
    assert all(len(c) <= 3 and max(widths[i] for i in c) <= 2 * min(widths[i] for i in c) for c in chunks)
    assert chunks == [[7, 0, 4], [2, 6], [3, 5], [1]]
    model = tiny_model(vocab_size=16, block_size=64, seed=6, rotary=True).double()
    prompts = [[4, 5, 6], [1, 2], [3, 3, 3, 3], [7]]
    groups = sample_groups(model, prompts, 4, 24, 15, [torch.Generator().manual_seed(s) for s in (5, 6, 7, 8)])
    assert len({g.tokens.size(1) for g in groups}) > 1
    one = _scored(model, groups, lambda: groups_logprobs(model, prompts, [g.tokens for g in groups]))

    def by_chunks():
        out = [None] * len(groups)
        for chunk in length_chunks([g.tokens.size(1) for g in groups], per=2):
            got = groups_logprobs(model, [prompts[i] for i in chunk], [groups[i].tokens for i in chunk])
            for i, lp in zip(chunk, got, strict=True):
                out[i] = lp
        return out

    several = _scored(model, groups, by_chunks)
    for x, y, g in zip(one[0], several[0], groups, strict=True):
        assert torch.allclose(x * g.weights, y * g.weights, rtol=1e-10, atol=1e-12)
    for name, grad in one[1].items():
        assert torch.allclose(grad, several[1][name], rtol=1e-8, atol=1e-10), name
