"""`gptforge pipeline RECIPE`: every stage from text to a chat model you can talk to, in one command. A recipe (TOML)
names the stages and their settings (recipe.py, checked before anything runs); each stage runs as its own gptforge
command in the pipeline folder (stages.py), is skipped when its output is complete and its settings and inputs are
unchanged, resumed when it was interrupted (run.py), and report.md gathers the figures the runs wrote (report.py).

Imports: chat, core, data, evaluate, infer, rl, tokenizer, weights."""
