"""Vocabularies: text to token ids and back. `spec` holds the tokenizers a run can use behind one interface (`char`,
`gpt2`, `bpe`: an own byte-level BPE, written for Hugging Face by `hf_format`), each described by a plain dict (its
spec) that meta.json and every checkpoint store. Imports only `core`, except `train` (training an own BPE), which
also reads documents through `data.sources` and sits above it."""
