"""DDP with real torchrun processes (gloo on CPU): same losses as one process, one log, exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_cli, tiny_train_args
from gptforge.weights.checkpoint import load_checkpoint
from test_modern import ALL_ON

# 2 ranks x 2 micro-batches = one process's 4, from the sharded loader: the same data either way
DDP_RUN = dict(
    data_loader="sharded",
    gradient_accumulation_steps=4,
    batch_size=4,
    max_iters=8,
    eval_interval=4,
    eval_iters=4,
    dropout=0.0,
    dtype="float32",
)


def torchrun(*args, nproc=2, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "gptforge",
        "train",
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


# each rank's script starts with this: gloo_threads() names the gloo threads alive, report(x) writes x for the test
GLOO_THREADS = """
import os, sys

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(name for name in names if "gloo" in name)

def report(value):
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w") as f:
        f.write(repr(value))
"""


def ranks_report(body: str, tmp_path: Path, *args, timeout: int = 120) -> list[str]:
    """GLOO_THREADS + body as a script on two torchrun ranks (argv: tmp_path, then args); what each rank reported."""
    script = tmp_path / "ranks.py"
    script.write_text(GLOO_THREADS + body)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    r = subprocess.run(
        [*cmd, str(tmp_path), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    return [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]


ENDS_ITS_GROUP = """
import torch, torch.distributed as dist
from gptforge.core.distributed import setup_distributed, teardown
env = setup_distributed("cpu", "auto")
import torch.distributed.fsdp  # what FSDP training and HellaSwag's sharded-model check import after setup,
import torch.distributed.checkpoint.state_dict  # and every checkpoint's state gathering
dist.all_reduce(torch.ones(3))
teardown(env)
report(gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_teardown_ends_gloos_threads_before_the_interpreter_does(tmp_path):
    """A process group left alive past teardown keeps gloo's threads running into the interpreter's shutdown,
    where a rank now and then aborts (SIGABRT) after finishing its work: teardown must leave no gloo thread."""
    left = ranks_report(ENDS_ITS_GROUP, tmp_path)
    assert left == ["[]", "[]"], f"gloo threads alive after teardown, per rank: {left}"


TRAINS_THEN_LISTS = """
import gptforge.train.loop as loop
from gptforge.cli.main import run

after_teardown = []
real_teardown = loop.teardown
def teardown(env):  # train's own teardown, then what it left
    real_teardown(env)
    after_teardown.append(gloo_threads())
loop.teardown = teardown
report((run(["train", *sys.argv[2:]]), after_teardown))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_ddp_training_leaves_no_gloo_thread_when_it_returns(char_data, tmp_path):
    """DDP's Reducer holds the process group: alive past teardown, the group was freed later with the GIL held
    while gloo's runloop needed it for the last collective's tensors, and a rank hung at exit (1 in ~40 two-rank
    runs) or aborted. `gptforge train` in-process on two ranks (evaluations, checkpoints, the final barrier): once
    its teardown ran, no gloo thread may be left on either rank."""
    left = ranks_report(
        TRAINS_THEN_LISTS, tmp_path, *tiny_train_args(char_data, tmp_path / "run", **DDP_RUN), timeout=240
    )
    assert left == ["(0, [[]])", "(0, [[]])"], f"(exit code, gloo threads alive after its teardown) per rank: {left}"


def one_process(char_data, out_dir, options):
    """The same training as one plain process (one thread, like each torchrun rank); returns its out_dir."""
    r = run_cli("train", *tiny_train_args(char_data, out_dir, **options), timeout=240, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return out_dir


@pytest.fixture(scope="module")
def references() -> dict:
    """One-process reference runs by their options, kept for the module: the ddp and fsdp rows of a test compare
    with the same run (`parallel` does nothing in one process: it never shards), trained once."""
    return {}


def reference(references: dict, char_data, out_dir, options):
    """one_process(char_data, out_dir, options), or the run an earlier test trained with the same options."""
    key = repr(sorted((k, v) for k, v in options.items() if k != "parallel"))
    if key not in references:
        references[key] = one_process(char_data, out_dir, options)
    return references[key]


def losses(out_dir):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [r["loss"] for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


@pytest.mark.slow
def test_ddp_matches_one_process_logs_once_and_resumes_exactly(char_data, tmp_path):
    common = DDP_RUN
    single = one_process(char_data, tmp_path / "single", common)
    ddp = tmp_path / "ddp"
    r = torchrun(*tiny_train_args(char_data, ddp, **common))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("iter 3: loss") == 1 and r.stdout.count("saved checkpoint") == 2  # rank 0 alone
    assert "2 process(es)" in r.stdout and "2 accumulation x 2 processes" in r.stdout
    one, one_evals = losses(single)
    two, two_evals = losses(ddp)
    assert len(one) == len(two) == 8
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-4, (one, two)
    for a, b in zip(one_evals, two_evals, strict=True):  # evaluations read the same windows, split over ranks
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-4
    assert sorted(os.listdir(ddp)) == sorted(os.listdir(single))  # one set of files, no per-rank copies

    # stop at step 4 and resume under DDP: the same losses as the uninterrupted DDP run
    part = tmp_path / "part"
    assert torchrun(*tiny_train_args(char_data, part, **{**common, "max_iters": 4})).returncode == 0
    r = torchrun(*tiny_train_args(char_data, part, **{**common, "init_from": "resume"}))
    assert r.returncode == 0, r.stderr[-3000:]
    resumed, _ = losses(part)
    assert max(abs(a - b) for a, b in zip(resumed, two, strict=True)) < 1e-6 and len(resumed) == 8


@pytest.fixture
def bpe_data_sharded(tmp_path: Path, tiktoken_cache: Path) -> Path:
    """A GPT-2 BPE dataset `bpe` whose val split shards over 2 ranks (~350 tokens)."""
    from gptforge.data.prepare import prepare

    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 300)
    prepare("text", data_dir=str(tmp_path / "data"), files=[str(tmp_path / "t.txt")], name="bpe", tokenizer="gpt2")
    return tmp_path / "data"


@pytest.mark.slow
@pytest.mark.parametrize("data", ["char_data", "bpe_data_sharded"])
def test_fsdp_matches_one_process_and_its_checkpoint_loads_in_one_process(data, request, tmp_path):
    """Also with GPT-2's vocabulary and a soft-cap: the loss from head_loss under FSDP."""
    char_data = request.getfixturevalue(data)
    common = {**DDP_RUN, "gradient_accumulation_steps": 2, "max_iters": 6, "eval_interval": 3, "eval_iters": 2}
    if data == "bpe_data_sharded":
        common.update(dataset="bpe", logit_softcap=15.0)
    single = one_process(char_data, tmp_path / "single", common)
    fsdp = tmp_path / "fsdp"
    r = torchrun(*tiny_train_args(char_data, fsdp, parallel="fsdp", **common))
    assert r.returncode == 0, r.stderr[-3000:]
    one, _ = losses(single)
    two, _ = losses(fsdp)
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-4, (one, two)

    # the gathered checkpoint holds whole tensors: it loads and samples in one plain process
    from gptforge.weights.checkpoint import load_checkpoint
    from gptforge.weights.load import load_checkpoint_model

    ckpt = load_checkpoint(str(fsdp / "ckpt.pt"))
    assert ckpt["optimizer_format"] == "fqn" and ckpt["iter_num"] == 6
    model, _, _ = load_checkpoint_model(str(fsdp / "ckpt.pt"), "cpu")
    reference = load_checkpoint(str(single / "ckpt.pt"))["model"]
    for key, value in model.state_dict().items():
        assert (value - reference[key]).abs().max() < 1e-4, key

    # and resumes under FSDP
    r = torchrun(
        *tiny_train_args(char_data, fsdp, parallel="fsdp", **{**common, "max_iters": 8, "init_from": "resume"})
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_checkpoint(str(fsdp / "ckpt.pt"))["iter_num"] == 8


def test_user_error_under_torchrun_exits_cleanly_on_every_rank(char_data, tmp_path):
    """gradient_accumulation_steps=3 does not divide across 2 processes: rank 0 prints the error once (no
    traceback) and exits 2, every rank tears its process group down, the other waits for torchrun to end it (so it
    cannot end rank 0 before it speaks: tests/test_hostile_inputs.py's rank-0-late row); torchrun returns promptly,
    no rank hangs."""
    r = torchrun(*tiny_train_args(char_data, tmp_path / "r", gradient_accumulation_steps=3), timeout=120)
    assert r.returncode != 0
    assert r.stderr.count("does not divide across 2 processes; make it a multiple of 2") == 1
    # torchrun reports the first rank to fail (it then stops the others): status 2, the user-error code
    assert "exitcode  : 2" in r.stderr
    assert "gptforge/train/loop.py" not in r.stderr  # and neither printed a traceback of ours
    assert not (tmp_path / "r").exists()  # nothing written before the check


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_muon_under_two_processes_equals_one_process(char_data, tmp_path, parallel, references):
    """With every model switch on. DDP: every rank orthogonalises the same averaged gradient. FSDP: every rank
    gathers each matrix whole, orthogonalises it and keeps its shard. Either way the weights equal one
    process's, and (FSDP) a resumed run continues as the uninterrupted one. Newton-Schulz in float32: in
    bfloat16 the last bits of the averaged gradient (summed in another order) round differently. With
    muon_split_qkv (FSDP: the gathered c_attn orthogonalised as its three row blocks, _orthogonalize_whole) and
    normuon (FSDP: the neurons' statistics kept whole on every rank, saved and resumed)."""
    common = {**DDP_RUN, **ALL_ON, "optimizer": "muon", "muon_warmup": 3, "parallel": parallel, "muon_dtype": "float32"}
    common["muon_split_qkv"] = True
    common["normuon"] = True
    single = reference(references, char_data, tmp_path / "single", common)
    r = torchrun(*tiny_train_args(char_data, tmp_path / "two", **common))
    assert r.returncode == 0, r.stderr[-3000:]
    one, _ = losses(single)
    two, _ = losses(tmp_path / "two")
    assert len(one) == len(two) == 8
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-5, (one, two)
    a, b = load_checkpoint(str(single / "ckpt.pt")), load_checkpoint(str(tmp_path / "two" / "ckpt.pt"))
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) < 1e-5
    if parallel == "ddp":
        assert torch.equal(a["optimizer"]["state"][0]["step"], b["optimizer"]["state"][0]["step"])
        return
    longer = {**common, "max_iters": 10}  # the schedule (lr_decay_iters 20) is the same
    r = torchrun(*tiny_train_args(char_data, tmp_path / "two", **{**longer, "init_from": "resume"}))
    assert r.returncode == 0, r.stderr[-3000:]
    whole, _ = losses(one_process(char_data, tmp_path / "whole", longer))
    resumed, _ = losses(tmp_path / "two")
    assert max(abs(a - b) for a, b in zip(whole, resumed, strict=True)) < 1e-5, (whole, resumed)


@pytest.mark.slow
def test_hellaswag_during_fsdp_training_equals_one_process_scoring_the_checkpoint(
    bpe_data, tmp_path, hellaswag_path, tiktoken_cache
):
    """Under FSDP every forward needs every rank: the rank with the smaller share (9 examples: 5 and 4) runs
    an uncounted forward so the counts match. The result logged at the last step equals `gptforge eval
    hellaswag` of the final checkpoint in one plain process."""
    from test_hellaswag_cli import parse_result

    out = tmp_path / "fsdp"
    run = {**DDP_RUN, "dataset": "bpe", "gradient_accumulation_steps": 2, "max_iters": 4, "parallel": "fsdp"}
    run["data_loader"] = "random"  # the val split, 79 tokens, holds too few windows to shard over 2 ranks
    r = torchrun(*tiny_train_args(bpe_data, out, hellaswag_interval=2, hellaswag_limit=9,
                                  hellaswag_path=hellaswag_path, **run))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    hs = [row for row in rows if row["kind"] == "hellaswag"]
    assert [row["step"] for row in hs] == [0, 2, 4] and all(row["n"] == 9 for row in hs)
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tiktoken_cache)}
    single = subprocess.run(
        [sys.executable, "-m", "gptforge", "eval", "hellaswag", f"--ckpt={out / 'ckpt.pt'}", "--limit=9",
         f"--hellaswag_path={hellaswag_path}", "--device=cpu"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr
    n, correct, correct_norm = parse_result(single.stdout)
    assert (hs[-1]["n"], hs[-1]["acc"], hs[-1]["acc_norm"]) == (n, correct / n, correct_norm / n)


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_under_fsdp_and_back(char_data, tmp_path):
    """DDP to step 4, FSDP from there to 6 (the optimizer state converted to FSDP's layout by parameter name),
    DDP again to 8 (from FSDP's layout): losses and weights equal one uninterrupted process's within 1e-5.
    Muon (Newton-Schulz in float32, as above) with NorMuon and every model switch on, so both optimizers' states
    make the trip, the neurons' statistics included."""
    common = {**DDP_RUN, **ALL_ON, "optimizer": "muon", "muon_warmup": 3, "muon_dtype": "float32", "normuon": True}
    whole, _ = losses(one_process(char_data, tmp_path / "whole", common))
    out = tmp_path / "switching"
    for max_iters, parallel in ((4, "ddp"), (6, "fsdp"), (8, "ddp")):
        resume = "resume" if max_iters > 4 else "scratch"
        r = torchrun(*tiny_train_args(char_data, out, **{**common, "max_iters": max_iters, "parallel": parallel,
                                                         "init_from": resume}))  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert load_checkpoint(str(out / "ckpt.pt"))["optimizer_format"] == ("fqn" if parallel == "fsdp" else "torch")
    switching, _ = losses(out)
    assert len(whole) == len(switching) == 8
    assert max(abs(a - b) for a, b in zip(whole, switching, strict=True)) < 1e-5, (whole, switching)
    a, b = load_checkpoint(str(tmp_path / "whole" / "ckpt.pt")), load_checkpoint(str(out / "ckpt.pt"))
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_onednn_products_under_ddp_and_fsdp_match_one_process(char_data, tmp_path, parallel, references):
    """onednn_f32 asked for (any x86 CPU), with micro-batches of 8 x 64 tokens so that the blocks' Linears of a
    64-wide model take oneDNN: DDP's and FSDP's ranks (FSDP's layers gathered from shards) give one process's
    losses."""
    from gptforge.core.cpu import onednn_f32_available

    if not onednn_f32_available():
        pytest.skip("oneDNN's matmul needs an x86-64 torch with oneDNN")
    common = {**DDP_RUN, "batch_size": 8, "block_size": 64, "n_embd": 64, "max_iters": 4, "onednn_f32": True}
    single = reference(references, char_data, tmp_path / "single", common)
    run = tmp_path / parallel
    r = torchrun(*tiny_train_args(char_data, run, parallel=parallel, **common))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "float32 products by oneDNN" in r.stdout
    one, _ = losses(single)
    two, _ = losses(run)
    assert len(one) == len(two) == 4
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-4, (one, two)
