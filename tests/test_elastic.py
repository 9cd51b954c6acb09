"""Runs that restart themselves and span hosts, with real torchrun processes (gloo on CPU): a rank killed with
SIGKILL under `torchrun --max-restarts`, after which the group restarts and `--resume=auto` continues from the
newest checkpoint to the weights of an uninterrupted run; and two "hosts" (network namespaces joined by a veth
pair) under `torchrun --nnodes=2` with c10d rendezvous, equal to one process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import tiny_train_args
from gptforge.weights.checkpoint import load_checkpoint
from test_distributed import DDP_RUN, losses, one_process

# big enough that a step takes tens of milliseconds, so that a kill lands mid-run
ELASTIC_RUN = dict(
    DDP_RUN,
    n_layer=4,
    n_embd=128,
    n_head=4,
    block_size=64,
    max_iters=40,
    lr_decay_iters=40,
    eval_interval=40,
    ckpt_interval=10,
    keep_last=2,
    resume="auto",
)


def torchrun_cmd(*launcher: str, train_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "gptforge", "train", *map(str, train_args)]


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = open(f"/proc/{entry}/stat").read()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def worker(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker process with RANK=rank, or None while it has not started."""
    for pid in children(agent):
        with contextlib.suppress(OSError):
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return pid
    return None


def last_step(out_dir) -> int:
    """The newest training step in metrics.jsonl, -1 before there is one (a line still being written is skipped)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    steps = [-1]
    with contextlib.suppress(FileNotFoundError), open(path) as fh:
        for line in fh:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                steps += [row["step"]] if row.get("kind") == "train" else []
    return steps[-1]


@pytest.mark.slow
def test_a_rank_killed_under_max_restarts_restarts_and_ends_as_an_uninterrupted_run(char_data, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ("--standalone", "--nproc_per_node=2", "--max-restarts=1")
    whole = tmp_path / "whole"
    r = subprocess.run(torchrun_cmd(*launcher, train_args=tiny_train_args(char_data, whole, **ELASTIC_RUN)),
                       capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]

    killed = tmp_path / "killed"
    start = time.monotonic()
    log = open(tmp_path / "killed.log", "w+")
    agent = subprocess.Popen(
        torchrun_cmd(*launcher, train_args=tiny_train_args(char_data, killed, **ELASTIC_RUN)),
        stdout=log, stderr=subprocess.STDOUT, env=env, text=True,
    )  # fmt: skip
    try:
        while last_step(killed) < 25:  # past two step checkpoints (10, 20), before the third
            assert agent.poll() is None and time.monotonic() - start < 240, "the run ended before the kill"
            time.sleep(0.02)
        victim = worker(agent.pid, rank=1)
        assert victim is not None, "no worker process with RANK=1 under torchrun"
        os.kill(victim, signal.SIGKILL)
        killed_at = last_step(killed)
        assert agent.wait(timeout=300) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    seconds = time.monotonic() - start
    output = (log.seek(0), log.read())[1]
    assert "torchrun restart 1 (of --max-restarts=1)" in output, output[-3000:]
    resumed_from = [line for line in output.splitlines() if line.startswith("resume=auto: resuming")]
    assert len(resumed_from) == 1 and f"from iter 20 ({killed / 'model_00020.pt'})" in resumed_from[0], output
    one, _ = losses(whole)
    two, _ = losses(killed)
    assert len(one) == len(two) == 40
    diff = max(abs(a - b) for a, b in zip(one, two, strict=True))
    a, b = load_checkpoint(str(whole / "ckpt.pt")), load_checkpoint(str(killed / "ckpt.pt"))
    assert a["iter_num"] == b["iter_num"] == 40
    weights = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    print(f"\nelastic: killed rank 1 (pid {victim}) at step {killed_at}, 1 restart, resumed from iter 20; "
          f"max |loss diff| {diff:.3g}, max |weight diff| {weights:.3g}, {seconds:.1f} s")  # fmt: skip
    assert diff == 0.0 and weights == 0.0  # fp32, sharded loader, the same world size: bit for bit


@contextlib.contextmanager
def two_hosts():
    """Two network namespaces joined by a veth pair, each with loopback and one address: (name, addr, iface) x 2."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2's `ip` to make network namespaces (CI runs as root)")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"gf-{tag}-{i}", f"10.231.{int(tag[:2], 16)}.{i}", f"gf{tag}{i}") for i in (1, 2)]
    (a, a_ip, a_if), (b, b_ip, b_if) = hosts

    def ip(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", *args], capture_output=True, text=True)

    made = ip("netns", "add", a)
    if made.returncode:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    try:
        steps = [("netns", "add", b), ("link", "add", a_if, "type", "veth", "peer", "name", b_if)]
        for name, addr, iface in hosts:
            steps += [("link", "set", iface, "netns", name), ("-n", name, "addr", "add", f"{addr}/24", "dev", iface)]
            steps += [("-n", name, "link", "set", iface, "up"), ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            r = ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr}"
        yield hosts
    finally:
        for name, _, _ in hosts:
            ip("netns", "del", name)


@pytest.mark.slow
def test_two_hosts_joined_by_a_veth_pair_equal_one_process(char_data, tmp_path):
    run = {**DDP_RUN, "gradient_accumulation_steps": 2}
    single = one_process(char_data, tmp_path / "single", run)
    out = tmp_path / "two"
    with two_hosts() as hosts:
        endpoint = f"{hosts[0][1]}:29417"
        nodes = []
        start = time.monotonic()
        for i, (name, addr, iface) in enumerate(hosts):
            # torchrun guesses whether it hosts the rendezvous store from its hostname's addresses, which the
            # namespaces share: the first host is told (--rdzv_conf=is_host=1), as on machines whose hostname
            # resolves to another address than the endpoint's
            launcher = ("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                        "--rdzv_id=gptforge-two-hosts", f"--rdzv_conf=is_host={int(i == 0)}",
                        f"--local_addr={addr}")  # fmt: skip
            train_args = tiny_train_args(char_data, out, **run)
            cmd = ["ip", "netns", "exec", name, *torchrun_cmd(*launcher, train_args=train_args)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": iface}
            nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        results = [node.communicate(timeout=300) for node in nodes]
        seconds = time.monotonic() - start
    for node, (_, stderr) in zip(nodes, results, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    saves = [stdout.count("saved checkpoint") for stdout, _ in results]
    assert sorted(saves) == [0, 2]  # rank 0's host writes the checkpoints (steps 4 and 8); the other none
    assert sorted(p.name for p in out.glob("*.pt")) == ["ckpt.pt", "ckpt_best.pt"] and not list(out.glob(".*.tmp"))
    assert any("2 process(es)" in stdout for stdout, _ in results)
    one, _ = losses(single)
    two, _ = losses(out)
    assert len(one) == len(two) == 8
    diff = max(abs(a - b) for a, b in zip(one, two, strict=True))
    print(f"\ntwo hosts: 2 nodes x 1 process over a veth pair, max |loss diff| {diff:.3g}, {seconds:.1f} s")
    assert diff < 1e-5, (one, two)
    a, b = load_checkpoint(str(single / "ckpt.pt")), load_checkpoint(str(out / "ckpt.pt"))
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) < 1e-5
    assert a["iter_num"] == b["iter_num"] == 8
