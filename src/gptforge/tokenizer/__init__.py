"""Vocabularies: text to token ids and back. `spec` holds the tokenizers a run can use behind one interface (`char`,
`gpt2`, `bpe`: an own byte-level BPE, written for Hugging Face by `hf_format`), each described by a plain dict (its
spec) that meta.json and every checkpoint store. `train` (training an own BPE) and `command` (with its `options`)
read documents through `data.sources` and sit above it; the rest imports only core.
Imports: core, data."""
