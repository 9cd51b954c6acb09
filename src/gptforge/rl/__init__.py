"""Reinforcement learning on verifiable tasks (`gptforge rl`), GRPO-style: a chat model samples a group of answers
to each prompt, a reward scores them (exact match on the synthetic tasks, or a function of your own), each answer's
advantage is its reward minus its group's mean, and a policy-gradient step is taken on the answers' own tokens.
`options` (the settings), `rewards` (prompts and rewards), `rollout` (a group sampled), `objective` (advantages and
the loss), `start` (where a run starts, its checkpoints), `evaluate` (held-out pass@1 / pass@k), `loop`.
Imports: chat, core, evaluate, infer, model, train, weights."""
