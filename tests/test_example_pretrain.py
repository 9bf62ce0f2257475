"""The pre-training example (``python -m ascend_moe_ops.examples.pretrain``): a few steps of the tiny
model on one process and on 4 gloo processes (2 emulated nodes x 2 ranks, hierarchical dispatcher,
overlap, KV recompute, dynamic expert placement). The multi-process loss curve must equal the
one-process curve within the fp32 tolerance, the placements and imbalance must be the same, experts
must really move, and the loss must fall."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ascend_moe_ops.examples import pretrain
from ascend_moe_ops.testing import tolerance

# tiny and short: 8 steps, a re-plan every 3 steps (two re-plans), 8 x 32 bytes per step
ARGS = ["--steps", "8", "--rebalance-every", "3", "--seq-len", "32", "--batch", "8", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pretrain"))
    pretrain.main(ARGS + ["--out", out])
    single = os.path.join(out, "pretrain-1proc.json")
    r = subprocess.run([sys.executable, "-m", "ascend_moe_ops.examples.pretrain", *ARGS, "--procs", "4",
                        "--local-size", "2", "--out", out, "--compare", single, "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(single) as f:
        one = json.load(f)
    with open(os.path.join(out, "pretrain-4proc-2x2.json")) as f:
        multi = json.load(f)
    return out, one, multi


def test_multi_process_loss_equals_single_process(runs):
    _, one, multi = runs
    assert (multi["world"], multi["nodes"], multi["local_size"]) == (4, 2, 2)
    assert multi["dispatcher"].startswith("hierarchical")
    atol, rtol = tolerance(torch.float32)
    a = torch.tensor([s["loss"] for s in one["steps"]], dtype=torch.float64)
    b = torch.tensor([s["loss"] for s in multi["steps"]], dtype=torch.float64)
    assert a.numel() == b.numel() == 8
    torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    aux_a = torch.tensor([s["aux_loss"] for s in one["steps"]], dtype=torch.float64)
    aux_b = torch.tensor([s["aux_loss"] for s in multi["steps"]], dtype=torch.float64)
    torch.testing.assert_close(aux_b, aux_a, atol=atol, rtol=rtol)


def test_same_routing_placements_and_moves(runs):
    _, one, multi = runs
    # the same tokens went to the same experts: identical loads, so identical imbalance and plans
    assert [s["imbalance_per_layer"] for s in multi["steps"]] == [s["imbalance_per_layer"] for s in one["steps"]]
    assert [s["moved_experts"] for s in multi["steps"]] == [s["moved_experts"] for s in one["steps"]]
    assert multi["final_placements"] == one["final_placements"]
    # experts really moved between the ranks (the executor checks its copies against the plan)
    assert sum(s["moved_experts"] for s in multi["steps"]) > 0
    contiguous = [[[r * 2, r * 2 + 1] for r in range(4)]] * one["config"]["layers"]
    assert multi["final_placements"] != contiguous


def test_loss_falls_and_outputs_written(runs):
    out, one, multi = runs
    losses = [s["loss"] for s in one["steps"]]
    assert losses[0] > 5.0                      # about ln(256) = 5.55 at the start
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5
    for mode in ("1proc", "4proc-2x2"):
        with open(os.path.join(out, f"pretrain-{mode}.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for log in (one, multi):
        assert log["corpus"]["bytes"] > 100_000 and "standard library" in log["corpus"]["source"]
        assert all(s["tokens_per_s"] > 0 for s in log["steps"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch 6"):
        pretrain.Trainer(pretrain.Config(batch=6), torch.zeros(10_000, dtype=torch.int64), world=4)
    with pytest.raises(ValueError, match="experts 6"):
        pretrain.Trainer(pretrain.Config(experts=6), torch.zeros(10_000, dtype=torch.int64))
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--procs", "3", "--local-size", "2"])
    assert e.value.code == 2


# the Python API applies the command line's rules (check_config): an odd qk_rope_dim trained a
# different model (the rope part grew to 4 dims), the others failed deep inside torch ("random_
# expects 'from' < 'to'", "stack expects a non-empty TensorList", "window must be >= 1")
@pytest.mark.parametrize("kw, err, named", [
    (dict(qk_rope_dim=3), ValueError, "qk_rope_dim 3 must be even"),
    (dict(seq_len=8192, corpus_bytes=4096), ValueError, "corpus_bytes 4096"),
    (dict(batch=0), ValueError, "batch must be >= 1"),
    (dict(rebalance_every=0), ValueError, "rebalance_every must be >= 1"),
    (dict(lr=0.0), ValueError, "lr must be a finite number > 0"),
    (dict(aux_coeff=float("nan")), ValueError, "aux_coeff"),
    (dict(steps="2"), TypeError, "steps must be an int"),
    (dict(top_k=9), ValueError, "top_k 9 must be <= experts 8"),
])
def test_config_is_checked_like_the_command_line(kw, err, named):
    with pytest.raises(err, match=named):
        pretrain.Config(**kw)
    ok = pretrain.Config(steps=1, batch=2, seq_len=16, corpus_bytes=4096)
    for k, v in kw.items():  # changed after construction: the run refuses it before any work
        setattr(ok, k, v)
    with pytest.raises(err, match=named):
        pretrain.run(ok, "unused-out", quiet=True)
    with pytest.raises(ValueError, match="data has 20 tokens"):
        pretrain.Trainer(pretrain.Config(seq_len=32), torch.zeros(20, dtype=torch.int64))
    with pytest.raises(ValueError, match="dim must be even"):
        pretrain.rope_tables(16, 3)


# each of these used to train and write outputs, or fail deep inside (ZeroDivisionError, "stack
# expects a non-empty TensorList", a numpy buffer error, "window must be >= 1, got -2"), or, for
# --compare, raise FileNotFoundError only after training; now argparse rejects them before any work
@pytest.mark.parametrize("argv, named", [
    (["--steps", "0"], "argument --steps"), (["--steps", "-1"], "argument --steps"),
    (["--aux-coeff", "-1"], "argument --aux-coeff"), (["--lr", "nan"], "argument --lr"),
    (["--lr", "0"], "argument --lr"), (["--seq-len", "0"], "argument --seq-len"),
    (["--batch", "0"], "argument --batch"), (["--corpus-bytes", "0"], "argument --corpus-bytes"),
    (["--corpus-bytes", "40", "--seq-len", "64"], "--corpus-bytes 40"),
    (["--threads", "-1"], "argument --threads"), (["--rebalance-every", "-1"], "argument --rebalance-every"),
    (["--procs", "0"], "argument --procs"), (["--local-size", "0"], "argument --local-size"),
    (["--max-moves", "-1"], "argument --max-moves"), (["--experts", "0"], "argument --experts"),
    (["--top-k", "9"], "--top-k 9"), (["--qk-rope-dim", "7"], "--qk-rope-dim 7"),
    (["--experts", "6"], "--experts 6"), (["--procs", "2", "--batch", "5"], "--batch 5"),
    (["--ep-ranks", "3", "--procs", "2"], "--ep-ranks 3"),
    (["--compare", "/nonexistent/run.json"], "argument --compare"),
])
def test_bad_flag_is_an_argparse_error_before_any_work(argv, named, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(pretrain, "run", lambda *a, **k: pytest.fail("trained with a bad flag"))
    with pytest.raises(SystemExit) as e:
        pretrain.main(argv + ["--out", str(tmp_path / "out"), "--quiet"])
    assert e.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ep_ranks_follow_the_process_count(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert pretrain.parse_args([]).ep_ranks == pretrain.Config().ep_ranks
    assert pretrain.parse_args(["--ep-ranks", "2"]).ep_ranks == 2
    assert pretrain.parse_args(["--procs", "4"]).ep_ranks == 4
    assert pretrain.parse_args(["--procs", "2", "--ep-ranks", "2"]).ep_ranks == 2
    assert pretrain.parse_args(["--shared-ffn", "0", "--aux-coeff", "0", "--seed", "0"]).shared_ffn == 0


def test_out_and_compare_checked_before_training(tmp_path, capsys, monkeypatch):
    """Each of these trained every step first, then failed: NotADirectoryError (nothing written),
    KeyError 'steps' (JSON written, PNG not), JSONDecodeError."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(pretrain, "run", lambda *a, **k: pytest.fail("trained with a bad flag"))
    f = tmp_path / "file"
    f.write_text("x")
    (tmp_path / "nosteps.json").write_text('{"a": 1}')
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "badsteps.json").write_text('{"mode": "1proc", "steps": [{"step": 0}]}')
    for argv, named in [(["--out", str(f / "x")], "argument --out: cannot create folder"),
                        (["--out", str(f)], "argument --out:"),
                        (["--compare", str(tmp_path / "nosteps.json")], "argument --compare:"),
                        (["--compare", str(tmp_path / "text.json")], "argument --compare:"),
                        (["--compare", str(tmp_path / "badsteps.json")], "argument --compare:")]:
        with pytest.raises(SystemExit) as e:
            pretrain.main(argv + ["--quiet"] + ([] if "--out" in argv else ["--out", str(tmp_path / "o")]))
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert named in err, err
        if "--compare" in argv:
            assert "is not a JSON log of this script" in err
    assert not (tmp_path / "o").exists()
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"mode": "1proc", "steps": [{"step": 0, "loss": 5.0}]}))
    assert pretrain.parse_args(["--compare", str(good), "--out", str(tmp_path / "o")]).compare == str(good)
