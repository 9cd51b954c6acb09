"""The ground floor: what every stage stands on and nothing of gptforge above it. `errors` (UserError), `console`
(messages and progress on stderr), `files` (run-folder names, atomic writes, downloads), `allocator` (glibc malloc
settings), `shape` (the model's shape keys, torch-free), `aliases` and `config` (TrainConfig and its loading),
`device` (device / dtype / compile resolution) and `distributed` (torchrun process groups, the stop flag). Imports only
the standard library, torch and numpy; the dashboard may use `errors`, `files` and `config`, which import no torch."""
