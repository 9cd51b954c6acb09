"""The ground floor: what every stage stands on, and nothing of gptforge above it. `errors` (UserError), `console`
(messages and progress on stderr), `files` (run-folder names, atomic writes and their stale temporaries, downloads),
`allocator` (glibc malloc settings), `settings` (how a setting is declared and checked), `shape` (the model's shape
keys, written once), `aliases` and `config` (TrainConfig and its loading), `memory` (what training needs, estimated
before anything is allocated), `cpu` (the CPU's kind and its measured product rates), `device` (device / dtype /
compile resolution), `distributed` (torchrun process groups, the stop flag) and `vml` (oneMKL's vector math kernels
picked once, on one thread). The standard library, torch and numpy only; everything before `cpu` is torch-free, so
the dashboard may use `errors`, `files` and `config`.
Imports: nothing of gptforge."""
