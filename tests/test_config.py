"""Configuration: nanoGPT's keys and defaults, config files read as data, overrides, and their errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gptforge.core.config import TrainConfig, help_text, load_config
from gptforge.core.config_file import load_settings
from gptforge.core.errors import UserError
from gptforge.rl.options import RLConfig

ROOT = Path(__file__).resolve().parent.parent

# nanoGPT's train.py, key by key (train.py at the top of its file).
NANOGPT_DEFAULTS = dict(
    out_dir="out",
    eval_interval=2000,
    log_interval=1,
    eval_iters=200,
    eval_only=False,
    always_save_checkpoint=True,
    init_from="scratch",
    wandb_log=False,
    wandb_project="owt",
    wandb_run_name="gpt2",
    dataset="openwebtext",
    gradient_accumulation_steps=40,
    batch_size=12,
    block_size=1024,
    n_layer=12,
    n_head=12,
    n_embd=768,
    dropout=0.0,
    bias=False,
    learning_rate=6e-4,
    max_iters=600000,
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,
    decay_lr=True,
    warmup_iters=2000,
    lr_decay_iters=600000,
    min_lr=6e-5,
    backend="nccl",
    device="cuda",
)


def test_defaults_are_nanogpts():
    cfg = TrainConfig()
    for key, value in NANOGPT_DEFAULTS.items():
        assert getattr(cfg, key) == value, key
        assert type(getattr(cfg, key)) is type(value), key
    assert cfg.dtype == "auto" and cfg.compile == "auto" and cfg.total_batch_size == 0 and cfg.data_dir == "data"


def test_every_field_is_documented_in_help():
    text = help_text()
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("doc"), f.name
        assert f"--{f.name}=" in text


def test_nanogpt_readme_cpu_command():
    args = (
        "config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 "
        "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 "
        "--lr_decay_iters=2000 --dropout=0.0"
    ).split()
    args[0] = str(ROOT / args[0])
    cfg = load_config(args)
    got = (cfg.device, cfg.compile, cfg.eval_iters, cfg.block_size, cfg.n_layer, cfg.n_embd)
    assert got == ("cpu", False, 20, 64, 4, 128)
    assert cfg.dropout == 0.0 and cfg.max_iters == 2000
    # from the file
    assert (cfg.dataset, cfg.out_dir, cfg.learning_rate, cfg.beta2, cfg.warmup_iters) == (
        "shakespeare_char",
        "out-shakespeare-char",
        1e-3,
        0.99,
        100,
    )
    # the shipped CPU config says the same thing
    assert load_config([str(ROOT / "config/train_shakespeare_char_cpu.py")]) == cfg


def test_shipped_configs_parse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out-chat-pretrain").mkdir()  # the chat recipe's SFT config starts from the pretraining run's folder
    for path in sorted((ROOT / "config").glob("*.py")):
        if path.name.startswith("chat_rl"):  # gptforge rl's settings, not train's
            load_settings(RLConfig, [str(path)], "rl")
            continue
        load_config([str(path)])
    gpt2 = load_config([str(ROOT / "config/train_gpt2.py")])
    assert gpt2.gradient_accumulation_steps == 40 and gpt2.wandb_run_name == "gpt2-124M"
    baby = load_config([str(ROOT / "config/train_shakespeare_char.py")])
    assert (baby.n_layer, baby.n_head, baby.n_embd, baby.block_size, baby.batch_size) == (6, 6, 384, 256, 64)
    assert (baby.dropout, baby.learning_rate, baby.max_iters) == (0.2, 1e-3, 5000)


def test_build_nanogpt_fineweb_config_is_their_run():
    path = ROOT / "config/train_gpt2_fineweb.py"
    cfg = load_config([str(path)])
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.bias) == (12, 12, 768, 1024, True)
    assert (cfg.dataset, cfg.out_dir, cfg.data_loader) == ("fineweb_edu", "log", "auto")
    assert cfg.total_batch_size == 2**19 == 524288 and cfg.batch_size == 64
    assert cfg.gradient_accumulation_steps == 8  # 64 x 1024 x 8 = 2**19: one micro-batch per GPU on 8
    assert (cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.weight_decay) == (6e-4, 6e-5, 715, 0.1)
    assert (cfg.max_iters, cfg.lr_decay_iters, cfg.lr_schedule, cfg.decay_lr) == (19073, 19073, "cosine", True)
    assert cfg.max_iters * cfg.total_batch_size == pytest.approx(10e9, rel=1e-3)  # one epoch of sample-10BT
    assert (cfg.eval_interval, cfg.hellaswag_interval, cfg.sample_interval, cfg.ckpt_interval) == (250, 250, 250, 5000)
    assert (cfg.compile, cfg.dtype, cfg.device) == (True, "bfloat16", "cuda")
    header = path.read_text()
    assert "torchrun --standalone --nproc_per_node=8 -m gptforge train config/train_gpt2_fineweb.py" in header
    assert "gptforge prepare fineweb_edu" in header and "3.29" in header and "0.2955" in header
    # prepare's folder is the recipe's name: the config's dataset
    from gptforge.data.shards import SHARD_RECIPES

    assert cfg.dataset in SHARD_RECIPES
    # a smaller micro-batch keeps the tokens per step
    assert load_config([str(path), "--batch_size=32"]).gradient_accumulation_steps == 16


def test_file_arithmetic_imports_and_order(tmp_path):
    f = tmp_path / "c.py"
    f.write_text(
        '"""doc"""\nimport time\nbatch_size = 4 * 3\nlearning_rate = 1e-3 / 2\nout_dir = "a" + "b"\n'
        "n_layer = -(-3)\ntotal_batch_size = 3 * 2**10\nblock_size=64\n"
    )
    cfg = load_config([str(f)])
    assert (cfg.batch_size, cfg.learning_rate, cfg.out_dir, cfg.n_layer) == (12, 5e-4, "ab", 3)
    assert cfg.total_batch_size == 3072 and cfg.gradient_accumulation_steps == 3072 // (12 * 64)
    # later arguments win, files and options alike
    assert load_config([str(f), "--n_layer=5"]).n_layer == 5
    g = tmp_path / "g.py"
    g.write_text("n_layer = 7\n")
    assert load_config(["--n_layer=5", str(f), str(g)]).n_layer == 7


def test_file_is_never_executed(tmp_path):
    marker = tmp_path / "ran"
    f = tmp_path / "evil.py"
    f.write_text(f"out_dir = open({str(marker)!r}, 'w').name\n")
    with pytest.raises(UserError, match=r"evil.py:1: the value of out_dir must be a literal"):
        load_config([str(f)])
    assert not marker.exists()
    f.write_text("for i in range(3):\n    pass\n")
    with pytest.raises(UserError, match="only `name = value` lines"):
        load_config([str(f)])
    f.write_text("x = = 1\n")
    with pytest.raises(UserError, match="evil.py:1: not a valid config file"):
        load_config([str(f)])


def test_override_forms():
    cfg = load_config(
        ["--batch_size", "4", "--device=cpu", "--compile", "--bias", "false", "--n-layer=3", "--min_lr", "1e-5"]
    )
    assert (cfg.batch_size, cfg.device, cfg.compile, cfg.bias, cfg.n_layer) == (4, "cpu", True, False, 3)
    assert cfg.min_lr == 1e-5
    assert load_config(["--compile", "auto", "--bias"]).compile == "auto"
    cfg = load_config(["--compile=auto", "--eval_only=True", "--always_save_checkpoint", "0"])
    assert (cfg.compile, cfg.eval_only, cfg.always_save_checkpoint) == ("auto", True, False)


def test_strings_keep_their_text_and_ints_become_floats():
    cfg = load_config(["--out_dir=2024", "--wandb_run_name=1e3", "--learning_rate=1", "--dropout=0"])
    assert cfg.out_dir == "2024" and cfg.wandb_run_name == "1e3"
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    assert isinstance(cfg.dropout, float)


def test_unknown_key_names_the_closest():
    with pytest.raises(UserError, match=r"unknown config key 'batchsize'; did you mean batch_size"):
        load_config(["--batchsize=3"])
    with pytest.raises(UserError, match=r"n_layers.*did you mean n_layer"):
        load_config(["--n_layers", "3"])


def test_unknown_key_in_file_names_file_and_line(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("batch_size = 2\nlearnig_rate = 0.1\n")
    with pytest.raises(UserError, match=r"c.py:2: unknown config key 'learnig_rate'; did you mean learning_rate"):
        load_config([str(f)])


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--batch_size=1.5", r"--batch_size: batch_size must be int, got 1.5 \(float\)"),
        ("--max_iters=2e3", r"max_iters must be int, got 2000.0"),
        ("--bias=maybe", r"bias must be bool, got 'maybe'"),
        ("--learning_rate=fast", r"learning_rate must be float, got 'fast' \(str\)"),
        ("--compile=sometimes", r"compile must be True, False or 'auto'"),
        ("--dtype=float8", r"dtype must be one of auto, float32, bfloat16, float16; got 'float8'"),
        ("--n_embd=100", r"n_embd=100 must be divisible by n_head=12"),
        ("--eval_iters=0", r"--eval_iters must be a positive integer, got 0"),
        ("--learning_rate=-1", r"--learning_rate must not be negative"),
        ("--learning_rate=1e999", r"--learning_rate must be a finite number, got inf"),
        ("--dashboard_port=65536", r"--dashboard_port must be a port number 0-65535"),
        ("--dropout=1.0", r"--dropout must be in \[0, 1\)"),
        ("--rope_base=0", r"--rope_base must be positive \(the rotary wavelength base, e.g. 10000\), got 0.0"),
        ("--logit_softcap=-15", r"--logit_softcap must not be negative, got -15.0"),
        ("--optimizer=sgd", r"optimizer must be one of adamw, muon; got 'sgd'"),
        ("--muon_momentum=1", r"--muon_momentum must be in \[0, 1\), got 1.0"),
        ("--muon_warmup=-3", r"--muon_warmup must not be negative, got -3"),
        ("--init_from=gpt3", r"--init_from must be 'scratch', 'resume', one of gpt2, gpt2-medium"),
    ],
)
def test_bad_values_name_key_value_and_type(arg, message):
    with pytest.raises(UserError, match=message):
        load_config([arg])


def test_file_value_of_wrong_type(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("batch_size = '12'\n")
    with pytest.raises(UserError, match=r"c.py:1: batch_size must be int, got '12' \(str\)"):
        load_config([str(f)])


def test_missing_value_and_missing_file():
    with pytest.raises(UserError, match="--batch_size needs a value"):
        load_config(["--batch_size"])
    with pytest.raises(UserError, match="--batch_size needs a value"):
        load_config(["--batch_size", "--device=cpu"])
    with pytest.raises(UserError, match="config file 'nope.py' not found"):
        load_config(["nope.py"])
    with pytest.raises(UserError, match="options start with --"):
        load_config(["batch_size=3"])


def test_total_batch_size_derives_gradient_accumulation():
    cfg = load_config(["--total_batch_size=4096", "--batch_size=8", "--block_size=64"])
    assert cfg.gradient_accumulation_steps == 8
    # build-nanogpt's run: 2**19 tokens, micro-batch 64 x 1024
    cfg = load_config(["--total_batch_size=524288", "--batch_size=64", "--block_size=1024"])
    assert cfg.gradient_accumulation_steps == 8
    with pytest.raises(UserError, match=r"total_batch_size=1000 is not a multiple of batch_size \* block_size"):
        load_config(["--total_batch_size=1000", "--batch_size=8", "--block_size=64"])
    with pytest.raises(UserError, match="contradicts total_batch_size"):
        load_config(["--total_batch_size=4096", "--batch_size=8", "--block_size=64", "--gradient_accumulation_steps=2"])
    same = load_config(
        ["--total_batch_size=4096", "--batch_size=8", "--block_size=64", "--gradient_accumulation_steps=8"]
    )
    assert same.gradient_accumulation_steps == 8


# build-nanogpt's flag names and the keys they stand for
ALIAS_CASES = [
    ("mini_batch_size", "batch_size", 64),
    ("context_length", "block_size", 256),
    ("num_layers", "n_layer", 6),
    ("num_heads", "n_head", 4),
    ("embd_size", "n_embd", 384),
    ("max_lr", "learning_rate", 1e-3),
    ("warmup_steps", "warmup_iters", 715),
    ("logdir", "out_dir", "log"),
]


@pytest.mark.parametrize("alias, key, value", ALIAS_CASES)
def test_build_nanogpt_aliases_in_both_forms_and_in_files(alias, key, value, tmp_path):
    for args in ([f"--{alias}={value}"], [f"--{alias}", str(value)], [f"--{alias.replace('_', '-')}={value}"]):
        assert getattr(load_config(args), key) == value, args
    f = tmp_path / "c.py"
    f.write_text(f"{alias} = {value!r}\n")
    assert getattr(load_config([str(f)]), key) == value
    # the same value under both names is fine; different ones are an error naming both
    assert getattr(load_config([f"--{alias}={value}", f"--{key}={value}"]), key) == value
    other = "elsewhere" if isinstance(value, str) else value * 2
    with pytest.raises(
        UserError,
        match=rf"--{alias}={value} and --{key}={other} disagree \({alias} is "
        rf"build-nanogpt's name for {key}\)",
    ):
        load_config([f"--{alias}={value}", f"--{key}={other}"])
    # in one file, both names with different values are an error too
    g = tmp_path / "g.py"
    g.write_text(f"{key} = {other!r}\n{alias} = {value!r}\n")
    with pytest.raises(
        UserError,
        match=rf"{alias} = {value!r} \(.*g.py:2\) and {key} = {other!r} \(.*g.py:1\) "
        "disagree",
    ):
        load_config([str(g)])
    # across places the later one wins, as for any key: the command line overrides a file, either name
    h = tmp_path / "h.py"
    h.write_text(f"{key} = {other!r}\n")
    assert getattr(load_config([str(h), f"--{alias}={value}"]), key) == value
    assert getattr(load_config([str(f), f"--{key}={other}"]), key) == other


def test_build_nanogpt_names_we_share_and_a_full_command():
    cfg = load_config(
        "--mini_batch_size=16 --context_length=1024 --num_layers=12 --num_heads=12 --embd_size=768 "
        "--max_lr=6e-4 --min_lr 6e-5 --warmup_steps=715 --weight_decay=0.1 --total_batch_size=524288 "
        "--steps_per_epoch=19073 --num_epochs=1 --eval_freq=250 --logdir=log --seed=1337".split()
    )
    assert (cfg.batch_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (16, 1024, 12, 12, 768)
    assert (cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.weight_decay) == (6e-4, 6e-5, 715, 0.1)
    assert (cfg.max_iters, cfg.lr_decay_iters, cfg.out_dir, cfg.seed) == (19073, 19073, "log", 1337)
    assert cfg.gradient_accumulation_steps == 524288 // (16 * 1024)
    assert (cfg.eval_interval, cfg.hellaswag_interval, cfg.sample_interval) == (250, 250, 250)
    assert cfg.ckpt_interval == 5000  # --logdir brings build-nanogpt's step checkpoints, unless given
    assert load_config(["--logdir=log", "--ckpt_interval=0"]).ckpt_interval == 0
    assert load_config(["--out_dir=log"]).ckpt_interval == 0
    # types follow the key: a float learning rate, an int alias rejects a float
    assert isinstance(load_config(["--max_lr=1"]).learning_rate, float)
    with pytest.raises(UserError, match=r"--mini_batch_size: mini_batch_size must be int, got 1.5"):
        load_config(["--mini_batch_size=1.5"])
    with pytest.raises(UserError, match="--num_layers needs a value"):
        load_config(["--num_layers"])


def test_steps_per_epoch_and_num_epochs_set_max_iters_and_lr_decay_iters(tmp_path):
    cfg = load_config(["--steps_per_epoch=100", "--num_epochs=3"])
    assert (cfg.max_iters, cfg.lr_decay_iters) == (300, 300)
    assert load_config(["--steps_per_epoch", "50"]).max_iters == 50  # num_epochs defaults to 1
    assert load_config(["--num_epochs=4"]).max_iters == 4  # and steps_per_epoch too
    cfg = load_config(["--steps_per_epoch=100", "--num_epochs=3", "--lr_decay_iters=250"])
    assert (cfg.max_iters, cfg.lr_decay_iters) == (300, 250)  # an explicit lr_decay_iters stays
    f = tmp_path / "c.py"
    f.write_text("lr_decay_iters = 280\nsteps_per_epoch = 10 * 10\n")
    assert (load_config([str(f), "--num_epochs=3"]).lr_decay_iters, load_config([str(f)]).max_iters) == (280, 100)
    assert load_config(["--steps_per_epoch=100", "--num_epochs=3", "--max_iters=300"]).max_iters == 300
    with pytest.raises(
        UserError,
        match=r"--steps_per_epoch=100 and --num_epochs=3 and --max_iters=200 disagree "
        r"\(max_iters = steps_per_epoch \* num_epochs = 300\)",
    ):
        load_config(["--steps_per_epoch=100", "--num_epochs=3", "--max_iters=200"])
    with pytest.raises(UserError, match=r"--num_epochs=0: num_epochs must be a positive integer"):
        load_config(["--num_epochs=0"])
    with pytest.raises(UserError, match=r"num_epochs must be int, got 1.5"):
        load_config(["--num_epochs=1.5"])


def test_eval_freq_sets_the_three_intervals_unless_given(tmp_path):
    cfg = load_config(["--eval_freq=100"])
    assert (cfg.eval_interval, cfg.hellaswag_interval, cfg.sample_interval) == (100, 100, 100)
    cfg = load_config(["--eval_freq=100", "--hellaswag_interval=0", "--sample_interval=500", "--eval_interval=100"])
    assert (cfg.eval_interval, cfg.hellaswag_interval, cfg.sample_interval) == (100, 0, 500)
    f = tmp_path / "c.py"
    f.write_text("hellaswag_interval = 0\n")
    assert load_config(["--eval_freq=100", str(f)]).hellaswag_interval == 0  # explicit anywhere, in any order
    with pytest.raises(UserError, match=r"--eval_freq=100 and --eval_interval=50 disagree"):
        load_config(["--eval_freq=100", "--eval_interval=50"])


def test_alias_last_one_wins_and_unknown_names_suggest_aliases():
    assert load_config(["--max_lr=1e-3", "--max_lr=2e-3"]).learning_rate == 2e-3
    assert load_config(["--max_lr=1e-3", "--learning_rate=2e-3", "--max_lr=2e-3"]).learning_rate == 2e-3
    with pytest.raises(UserError, match=r"unknown config key 'mini_batchsize'; did you mean mini_batch_size"):
        load_config(["--mini_batchsize=3"])
    with pytest.raises(UserError, match=r"unknown config key 'num_epoch'; did you mean num_epochs"):
        load_config(["--num_epoch=3"])


def test_help_lists_the_aliases():
    from gptforge.core.aliases import ALIASES, EPOCH_NAMES, alias_help

    text = alias_help()
    for alias, key in ALIASES.items():
        assert f"--{alias}" in text and key in text
    assert all(f"--{name}" in text for name in EPOCH_NAMES) and "--seed" in text


def test_lr_schedule_choices_and_ranges():
    assert TrainConfig().lr_schedule == "cosine" and TrainConfig().decay_frac == 0.2
    cfg = load_config(["--lr_schedule=wsd", "--decay_frac=0.5"])
    assert (cfg.lr_schedule, cfg.decay_frac) == ("wsd", 0.5)
    assert load_config(["--lr_schedule", "linear"]).lr_schedule == "linear"
    with pytest.raises(UserError, match=r"lr_schedule must be one of cosine, linear, constant, wsd; got 'step'"):
        load_config(["--lr_schedule=step"])
    for bad in ("-0.1", "1.5"):
        with pytest.raises(UserError, match=rf"--decay_frac must be in \[0, 1\] .*got {bad}"):
            load_config([f"--decay_frac={bad}"])
    # nanoGPT's decay_lr=False (constant learning_rate) with a decaying schedule asked for is a contradiction
    with pytest.raises(UserError, match=r"--lr_schedule=wsd decays the learning rate, but decay_lr=False"):
        load_config(["--decay_lr=False", "--lr_schedule=wsd"])
    assert not load_config(["--decay_lr=False", "--lr_schedule=constant"]).decay_lr
    assert not load_config([str(ROOT / "config/finetune_shakespeare.py")]).decay_lr  # no schedule given: fine
