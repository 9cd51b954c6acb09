"""Vocabularies: text to token ids and back. `spec` holds the tokenizers a run can use behind one interface, each
described by a plain dict (its spec) that meta.json and every checkpoint store. Imports only `core`."""
