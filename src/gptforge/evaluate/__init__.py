"""Evaluation: validation loss and bits per byte (`loss`, shared by training and `gptforge eval loss`), a chat
model's held-out synthetic tasks (`chat`), HellaSwag (`hellaswag`) and lm-evaluation-harness (`harness_model`,
`harness`: `gptforge eval lm-eval`); `options` holds each `gptforge eval` command's options.
Imports: chat, core, data, infer, model, tokenizer, weights."""
