"""Using a trained model: `options` (sample's, chat's and serve's), `engine` (generation, the KV cache's rows),
`decode` (a compiled one-token step), `sample` (`gptforge sample`, and samples during training), `chat_model`,
`session` and `chat_cli` (`gptforge chat`), and `batcher`, `openai_api`, `serve_options` and `serve` (`gptforge
serve`: OpenAI's API with continuous batching, and the chat page).
Imports: chat, core, data, model, tokenizer, weights."""
