"""Chat data: conversations read from JSONL (OpenAI messages, ShareGPT, Alpaca) and from the chitchat-dataset package
(`conversations`), the one renderer that turns a conversation into token ids and the loss mask (`render`), best-fit
packing of rendered conversations into BOS-aligned rows with their document boundaries, written as numpy shards by
`prepare_chat` (`pack`), offline synthetic tasks with exact answers and an exact-match scorer (`synthetic`), and the
Jinja chat template that makes a Hugging Face GPT-2 tokenizer folder render the same ids and mask (`template`), and
tools: OpenAI's tool calls read and checked, the functions a conversation offers, the built-in tools (`tools`), among
them the calculator with a parser of its own (`calculator`).
transformers is never imported here.
Imports: core, tokenizer."""
