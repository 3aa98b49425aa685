"""``pyperm align`` and ``pyperm merge`` over 2 gloo ranks (as under torchrun): the written folder is byte for
byte one process's,
a rank with other checkpoints is refused at the start, and a failing rank ends both with nothing left
under the output's names."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402
from _ranks import run_ranks, values  # noqa: E402
from _vision import import_transformers  # noqa: E402

from pyperm.testing import free_port  # noqa: E402
from pyperm.cli import main  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with the gloo backend")  # fmt: skip

transformers = import_transformers()


def _llama(seed: int, folder, sharded: bool) -> str:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=16, vocab_size=50,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(folder), max_shard_size="20KB" if sharded else "1GB")
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {str(i): i for i in range(50)}}}))
    return str(folder)


def _align(rank, world, argv_of_rank, fail_on_rank=None, how="raises"):
    """The command's entry function on one rank, its exit status and what it printed on stderr."""
    if rank == fail_on_rank:
        import pyperm.checkpoints._write as write

        def fail(*args, **kwargs):
            if how == "killed":
                os._exit(9)  # as a rank killed while writing
            raise OSError(28, "No space left on device (a failure planted by the test)")

        write.stage_shards = write.stage_file = fail
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv_of_rank[rank])
    return code, err.getvalue()


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("sharded", "world", "init"), [(True, 2, "identity"), (False, 2, "identity"),
                                                      (True, 3, "identity"), (True, 2, "best"), (True, 2, "signatures")],
                         ids=["sharded", "one-file", "3-ranks", "best", "signatures"])  # fmt: skip
def test_align_over_ranks_writes_what_one_process_writes(tmp_path, sharded, world, init):
    a, b = _llama(0, tmp_path / "a", sharded), _llama(1, tmp_path / "b", sharded)
    argv = ["align", a, b, "--model", "hf", "--no-progress", "--init", init]
    assert main(argv + ["--out", str(tmp_path / "one")]) == 0
    (tmp_path / "ranks").mkdir()
    outcomes = values(run_ranks(_align, world, tmp_path / "ranks", [argv + ["--out", str(tmp_path / "two")]] * world))
    assert [code for code, _ in outcomes] == [0] * world, outcomes
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == sorted(two)
    assert (tmp_path / "two" / "b_permuted" / "model.safetensors.index.json").exists() == sharded
    for name in one:
        if not name.startswith("report."):  # the reports hold timings and the ranks
            assert one[name] == two[name], name
    report = json.loads((tmp_path / "two" / "report.json").read_text())
    assert report["ranks"] == world and any(g["units_moved"] for g in report["groups"])
    assert not any(p.name.endswith(".pyperm-partial") for p in (tmp_path / "two").rglob("*"))


def test_a_rank_with_another_checkpoint_is_refused_at_the_start(tmp_path):
    a, b = _llama(0, tmp_path / "a", True), _llama(1, tmp_path / "b", True)
    c = _llama(2, tmp_path / "c", True)
    argv = ["align", a, "--model", "hf", "--no-progress", "--out", str(tmp_path / "out")]
    (tmp_path / "ranks").mkdir()
    outcomes = values(run_ranks(_align, 2, tmp_path / "ranks", [argv[:2] + [b] + argv[2:], argv[:2] + [c] + argv[2:]]))
    for code, err in outcomes:
        assert code == 1 and "rank 1 differs from rank 0 in its b" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("failing", "how"), [(0, "raises"), (1, "raises"), (1, "killed")])
def test_a_failing_rank_ends_both_and_leaves_nothing_under_the_output_names(tmp_path, failing, how):
    a, b = _llama(0, tmp_path / "a", True), _llama(1, tmp_path / "b", True)
    out = tmp_path / "out"
    argv = ["align", a, b, "--model", "hf", "--no-progress", "--out", str(out), "--rank-timeout", "5"]
    (tmp_path / "ranks").mkdir()
    outcomes = run_ranks(_align, 2, tmp_path / "ranks", [argv] * 2, failing, how, deadline=90)
    if how == "killed":
        assert outcomes[failing] == ("exit", 9), outcomes
        named = f"rank {failing} "  # "rank 1 failed: ..." or "rank 1 stopped (no heartbeat ...)"
    else:
        assert outcomes[failing][0] == "ok" and outcomes[failing][1][0] == 1, outcomes
        assert "No space left on device" in outcomes[failing][1][1]
        named = f"rank {failing} failed"
    # The other rank raises an error naming the failed rank, or its watchdog ends it (exit status 1).
    other = outcomes[1 - failing]
    assert other == ("exit", 1) or (other[0] == "ok" and other[1][0] == 1 and named in other[1][1]), other
    left = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert all(p.name.startswith(".") and p.name.endswith(".pyperm-partial") for p in left), left
    # The next run (one process) writes into the same folder without --force, and removes the leftovers.
    shutil.rmtree(tmp_path / "ranks")
    assert main(argv[:-2] + ["--init", "identity"]) == 0
    assert not any(p.name.endswith(".pyperm-partial") for p in out.rglob("*"))


def test_torchrun_is_detected_through_its_environment(monkeypatch):
    from pyperm.commands._over_ranks import launched

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not launched()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert not launched(), "LOCAL_RANK missing: not torchrun"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launched()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not launched(), "one rank: the one-process command"


def test_a_rank_maps_only_its_shards(tmp_path):
    from pyperm.checkpoints import load_checkpoint
    from pyperm.commands._over_ranks import _my_shards, key_owners

    folder = _llama(0, tmp_path / "a", True)
    whole = load_checkpoint(folder)
    for rank in range(2):
        mine = load_checkpoint(folder, shards=lambda weight_map, r=rank: _my_shards(weight_map, r, 2))
        owners = key_owners(whole, 2)
        assert set(owners.values()) == {0, 1}
        for key, tensor in mine.state.items():
            assert tensor.is_meta == (owners[key] != rank), key
            assert tensor.shape == whole.state[key].shape and tensor.dtype == whole.state[key].dtype
            if not tensor.is_meta:
                assert torch.equal(tensor, whole.state[key])


def test_barrier_does_not_split_its_work_and_refuses_to_run_over_ranks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("pyperm.commands._over_ranks.launched", lambda: True)
    assert main(["barrier", "a", "b", "--model", "hf", "--out", str(tmp_path / "o"), "--data", "digits"]) == 1
    assert "does not run over ranks" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("sharded", "method"), [(True, "mergemany"), (False, "mergemany"), (True, "c2m3")],
                         ids=["sharded", "one-file", "c2m3"])  # fmt: skip
def test_merge_over_ranks_writes_what_one_process_writes(tmp_path, sharded, method):
    ckpts = [_llama(seed, tmp_path / f"m{seed}", sharded) for seed in range(3)]
    argv = ["merge", *ckpts, "--model", "hf", "--no-progress", "--method", method, "--max-iter", "5"]
    assert main(argv + ["--out", str(tmp_path / "one")]) == 0
    (tmp_path / "ranks").mkdir()
    outcomes = values(run_ranks(_align, 2, tmp_path / "ranks", [argv + ["--out", str(tmp_path / "two")]] * 2))
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == sorted(two)
    for name in one:
        if not name.startswith("report."):
            assert one[name] == two[name], name
    report, single = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("two", "one"))
    assert report["ranks"] == 2 and report["method"] == single["method"] == method
    assert report["iterations"] == single["iterations"] > 1
    if method == "c2m3":
        assert report["c2m3"]["objective"] == pytest.approx(single["c2m3"]["objective"], rel=1e-9)
        assert report["c2m3"]["cycle_error"] == 0.0
        assert "Frank-Wolfe iterations of C2M3" in (tmp_path / "two" / "report.md").read_text()


def test_merge_over_ranks_refuses_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("pyperm.commands._over_ranks.launched", lambda: True)
    assert main(["merge", "a", "b", "--model", "hf", "--out", str(tmp_path / "o"), "--data", "digits"]) == 1
    assert "--data: over ranks" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("nodes", "command"), [(1, "align"), (2, "align"), (1, "merge-c2m3")],
                         ids=["one-node", "two-nodes", "merge-c2m3"])  # fmt: skip
def test_torchrun_runs_the_module_over_two_ranks(tmp_path, nodes, command):
    """The real launcher: ``torchrun --nproc-per-node 2 -m pyperm align`` (its rendezvous on 127.0.0.1 only)
    joins the process group itself (``env://``) and writes what one process writes; the same with two
    launchers of one rank each, as two nodes would start it (``--nnodes 2 --node-rank i``); and ``pyperm
    merge --method c2m3`` in fresh processes as users start it."""
    if command == "align":
        a, b = _llama(0, tmp_path / "a", True), _llama(1, tmp_path / "b", True)
        argv = ["align", a, b, "--model", "hf", "--no-progress"]  # the default start on both sides
    else:
        ckpts = [_llama(seed, tmp_path / f"m{seed}", True) for seed in range(3)]
        argv = ["merge", *ckpts, "--model", "hf", "--no-progress", "--method", "c2m3", "--max-iter", "5"]
    assert main(argv + ["--out", str(tmp_path / "one")]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    port = str(free_port())
    per_node = ["--nproc-per-node", str(2 // nodes)] + (["--nnodes", "2"] if nodes == 2 else [])
    # From tmp_path: ``-m`` puts the working directory first on the path, and a source checkout there (CI
    # tests the installed wheel) would shadow the installed package.
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *per_node,
                                   *(["--node-rank", str(node)] if nodes == 2 else []),
                                   "--master-addr", "127.0.0.1", "--master-port", port,
                                   "-m", "pyperm", *argv, "--out", str(tmp_path / "two")],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
                 for node in range(nodes)]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=180) for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    assert [p.returncode for p in launchers] == [0] * nodes, [err[-3000:] for _, err in outputs]
    assert "over 2 ranks" in outputs[0][0]
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == sorted(two)
    assert all(one[n] == two[n] for n in one if not n.startswith("report.")), [n for n in one if one[n] != two[n]]


_GROUP_AFTER_EXPORT = """
import os
import sys

import torch

from pyperm.commands._over_ranks import process_group


def gloo_threads():
    return [n for n in (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
            if "gloo" in n]


with process_group(torch.device("cpu")):
    import torch._dynamo  # what torch.export imports when a model is traced inside the group
    import torch.distributed as dist

    every = [None]
    dist.all_gather_object(every, {"rank": 0})
    dist.barrier()
    assert gloo_threads(), "no gloo threads while the group is up"
print(gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads' names from /proc")
def test_the_command_lines_group_is_freed_after_torch_export_is_imported_in_it(tmp_path):
    """``torch.distributed.nn.functional`` (imported by torch.export) takes ``group.WORLD`` as default arguments:
    imported inside the group, it would hold it past ``destroy_process_group``, and gloo's threads, living on
    into the interpreter's shutdown, abort the process there now and then (SIGABRT). The command line's group
    imports it first: none of gloo's threads is left once the group is destroyed."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", _GROUP_AFTER_EXPORT], env=env, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


# A user's own script: pyperm.distributed imported before its own init_process_group (the guide's advice).
_OWN_GROUP_AFTER_EXPORT = """
import os

import torch
import torch.distributed as dist

import pyperm.distributed  # noqa: F401  (before the group: torch's group defaults are imported without it)


def gloo_threads():
    return [n for n in (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
            if "gloo" in n]


dist.init_process_group("gloo")
import torch._dynamo  # noqa: E402, F401  (what torch.export imports when a model is traced inside the group)

dist.all_gather_object([None], {"rank": 0})
dist.barrier()
assert gloo_threads(), "no gloo threads while the group is up"
dist.destroy_process_group()
print(gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads' names from /proc")
def test_a_scripts_own_group_is_freed_when_it_imports_pyperm_distributed_first(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", _OWN_GROUP_AFTER_EXPORT], env=env, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_importing_pyperm_nn_does_not_import_torch_distributed_nn_functional(tmp_path):
    """Only pyperm.distributed (and pyperm's own init_process_group) import it: importing the library's methods
    does not import parts of torch the caller did not ask for."""
    code = ("import sys\nimport pyperm.nn\nimport pyperm.nn.align.over_ranks\nimport pyperm.commands.align\n"
            "print('torch.distributed.nn.functional' in sys.modules)\nimport pyperm.distributed\n"
            "print('torch.distributed.nn.functional' in sys.modules)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"], proc.stdout
