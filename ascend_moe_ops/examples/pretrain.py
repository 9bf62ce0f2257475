"""Pre-train a scaled-down Pangu Ultra MoE on byte-level text of the Python standard library.

    python -m ascend_moe_ops.examples.pretrain --steps 200                              # one process
    python -m ascend_moe_ops.examples.pretrain --steps 200 --procs 4 --local-size 2     # 2 nodes x 2 ranks

The model follows the recipe of the Pangu Ultra MoE report (arXiv 2505.04519), shrunk to run on a
laptop CPU: every layer is MLA attention (latent KV with a shared rope key, ``recompute="kv"``:
only the latent is kept for backward) followed by a dropless MoE FFN (softmax router, top-k of the
routed experts plus one shared expert) with the auxiliary load-balancing loss at the EP-group level.
It is built only from this package's modules (:func:`ascend_moe_ops.mla_attention`,
:class:`ascend_moe_ops.nn.MoELayer`, :mod:`ascend_moe_ops.distributed`, :mod:`ascend_moe_ops.balance`)
and plain ``torch.nn`` pieces (embedding, RMSNorm, linear projections).

With ``--procs P`` the script spawns ``P`` gloo processes (or runs under ``torchrun``); the EP group
is the world, split into ``P / local_size`` emulated nodes by :class:`EPTopology`. Each rank takes
``1/P`` of every global batch (data parallel for the dense weights, whose gradients are summed with
one all-reduce) and owns ``E/P`` experts (expert parallel): the MoE layers dispatch with the
node-deduplicated hierarchical :class:`MoEDispatcher` and pipeline ``--overlap-chunks`` chunks so
the exchanges overlap expert compute and the shared expert. Every ``--rebalance-every`` steps an
:class:`ExpertLoadPredictor` forecasts each layer's expert load, :func:`plan_placement` proposes a
placement with at most ``--max-moves`` expert copies, and :class:`PlacementExecutor` moves the
expert weights and their Adam state between ranks and updates the dispatcher's map. The one-process
run tracks the same placements for the same number of (virtual) EP ranks, so its imbalance and
moved-expert columns are comparable; there it moves nothing.

The loss on every rank is its tokens' summed cross entropy divided by the global token count, plus
``1/P`` of its EP-group auxiliary loss, so the summed gradients are those of the one-process run:
the multi-process loss curve equals the one-process curve up to fp32 summation order (tested).

Per step it prints loss, auxiliary loss, imbalance (max/mean - 1 of the EP ranks' token loads,
mean over layers, under the placement in use), experts moved and tokens/s; it writes a JSON log
and a PNG (loss and imbalance over steps) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import platform
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _cli
from ..benchmark.timing import clock_for
from ..ops import checks as _checks
from ..balance import (ExpertLoadPredictor, Placement, PlacementExecutor, aux_loss, canonical,
                       imbalance, plan_placement)
from ..distributed import EPTopology, MoEDispatcher
from ..nn import MoELayer
from ..ops.mla_attention import mla_attention

VOCAB = 256  # byte-level tokens
_clock = clock_for("cpu")  # the benchmark harness's clock (tokens/s of a step)


@dataclasses.dataclass
class Config:
    """Model and run settings (defaults: ~0.5 M parameters, a few seconds per 10 steps on 2 cores).

    The real Pangu Ultra MoE: hidden 7680, 61 layers, 128 heads, MLA 512 latent / 128 nope /
    64 rope / 128 value, 256 routed experts of FFN 2048 + 1 shared, top-8."""
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    qk_nope_dim: int = 16
    qk_rope_dim: int = 8
    v_dim: int = 16
    kv_lora_rank: int = 32
    experts: int = 8
    top_k: int = 2
    ffn: int = 32
    shared_ffn: int = 64
    seq_len: int = 64
    batch: int = 8                 # global sequences per step (divisible by the process count)
    steps: int = 100
    lr: float = 3e-3
    aux_coeff: float = 1e-2
    rebalance_every: int = 10
    max_moves: int = 2
    overlap_chunks: int = 2
    ep_ranks: int = 4              # EP ranks (virtual ones in the one-process run)
    seed: int = 0
    corpus_bytes: int = 1 << 21

    def __post_init__(self):
        check_config(self)


#: Config fields that may be 0 (every other one must be >= 1, or for floats > 0)
_MAY_BE_ZERO = ("shared_ffn", "max_moves", "seed", "aux_coeff")


def _field_name(field: str, flags: bool) -> str:
    return "--" + field.replace("_", "-") if flags else field


def check_config(cfg, world: int = 1, *, flags: bool = False) -> None:
    """The rules a run's settings obey, for :class:`Config` (at construction and when a
    :class:`Trainer` starts, with its process count ``world``) and for the command line (which
    passes its parsed arguments with ``flags=True``, so the messages name the flags). Each value:
    an int ``>= 1`` (``>= 0`` for ``_MAY_BE_ZERO``) or a finite float ``> 0`` (``>= 0``); together:
    the experts divide evenly over the EP ranks and the batch over the processes, ``top_k <=
    experts``, an even ``qk_rope_dim`` (the rotary embedding rotates halves), and a corpus longer
    than one sequence window. Raises ``TypeError``/``ValueError`` naming the setting."""
    def name(f):
        return _field_name(f, flags)
    if not flags:  # argparse's types already checked each flag on its own
        for f in dataclasses.fields(Config):
            v, low = getattr(cfg, f.name), 0 if f.name in _MAY_BE_ZERO else 1
            if isinstance(f.default, float):
                _checks.check_float(name(f.name), v, finite=True, minimum=0.0)
                if low and not v > 0:
                    raise ValueError(f"{name(f.name)} must be a finite number > 0, got {v!r}")
            else:
                _checks.check_int(name(f.name), v, minimum=low)
    R = cfg.ep_ranks
    if cfg.experts % R:
        raise ValueError(f"{name('experts')} {cfg.experts} must be divisible by the EP ranks ({R})")
    if cfg.batch % world:
        raise ValueError(f"{name('batch')} {cfg.batch} must be divisible by the process count {world}")
    if world > 1 and R != world:
        raise ValueError(f"with {world} processes the EP group has {world} ranks, got "
                         f"{name('ep_ranks')}={R}")
    if cfg.top_k > cfg.experts:
        raise ValueError(f"{name('top_k')} {cfg.top_k} must be <= {name('experts')} {cfg.experts}")
    if cfg.qk_rope_dim % 2:
        raise ValueError(f"{name('qk_rope_dim')} {cfg.qk_rope_dim} must be even (the rotary "
                         "embedding rotates halves)")
    if cfg.corpus_bytes < cfg.seq_len + 2:
        raise ValueError(f"{name('corpus_bytes')} {cfg.corpus_bytes} must be >= {name('seq_len')} + 2 "
                         f"({cfg.seq_len + 2}): each sequence is a window of seq_len + 1 bytes of the "
                         "corpus")


# --------------------------------------------------------------------------------------- data
def corpus(max_bytes: int):
    """Bytes of the standard library's top-level ``*.py`` files (sorted by name) as int64 tokens,
    and a description of where they came from."""
    root = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    buf = bytearray()
    used = 0
    for path in files:
        with open(path, "rb") as f:
            buf += f.read()
        used += 1
        if len(buf) >= max_bytes:
            break
    if len(buf) < 4096:
        raise RuntimeError(f"too little text in the standard library at {root} ({len(buf)} bytes)")
    data = torch.frombuffer(bytearray(buf[:max_bytes]), dtype=torch.uint8).to(torch.int64)
    return data, dict(source=f"Python {platform.python_version()} standard library *.py",
                      files=used, bytes=int(data.numel()))


def global_batch(data: torch.Tensor, step: int, cfg: Config):
    """The step's ``[batch, seq_len]`` inputs and next-byte targets (same on every rank)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch,), generator=g)
    rows = torch.stack([data[s:s + cfg.seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# -------------------------------------------------------------------------------------- model
def rope_tables(seq_len: int, dim: int, base: float = 10000.0):
    """``cos, sin [seq_len, dim / 2]`` of the rotary embedding of an even ``dim``."""
    _checks.check_int("dim", dim, minimum=2)
    if dim % 2:
        raise ValueError(f"dim must be even (the rotary embedding rotates halves), got {dim}")
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the last dim (halves rotated), ``cos/sin [S, dim/2]`` broadcast over
    the batch (and heads: pass them with a head axis)."""
    if x.shape[-1] != 2 * cos.shape[-1]:
        raise ValueError(f"x's last dim must be twice that of cos/sin ({2 * cos.shape[-1]}), got "
                         f"shape {tuple(x.shape)}")
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention: q projection, KV down-projection to a normed latent plus one
    shared rope key, :func:`ascend_moe_ops.mla_attention` (up-projection inside, recompute="kv"),
    output projection."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        H, nh = cfg.hidden, cfg.heads
        self.q_proj = nn.Linear(H, nh * (cfg.qk_nope_dim + cfg.qk_rope_dim), bias=False)
        self.kv_down = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank)
        self.kv_up = nn.Parameter(torch.randn(nh * (cfg.qk_nope_dim + cfg.v_dim), cfg.kv_lora_rank) * 0.02)
        self.o_proj = nn.Linear(nh * cfg.v_dim, H, bias=False)

    def forward(self, x, cos, sin):
        c = self.cfg
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, c.heads, c.qk_nope_dim + c.qk_rope_dim)
        q = torch.cat([q[..., :c.qk_nope_dim], rope(q[..., c.qk_nope_dim:], cos[:, None], sin[:, None])], -1)
        c_kv, k_pe = self.kv_down(x).split([c.kv_lora_rank, c.qk_rope_dim], dim=-1)
        out = mla_attention(q.contiguous(), self.kv_norm(c_kv).contiguous(), rope(k_pe, cos, sin).contiguous(),
                            self.kv_up, num_heads=c.heads, qk_nope_dim=c.qk_nope_dim, v_dim=c.v_dim,
                            softmax_scale=(c.qk_nope_dim + c.qk_rope_dim) ** -0.5, causal=True,
                            recompute="kv")
        return self.o_proj(out.reshape(B, S, c.heads * c.v_dim))


class Block(nn.Module):
    def __init__(self, cfg: Config, dispatcher: Optional[MoEDispatcher] = None):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden)
        self.attn = MLAttention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden)
        self.moe = MoELayer(cfg.hidden, cfg.experts, cfg.ffn, cfg.top_k,
                            shared_expert_ffn_hidden_size=cfg.shared_ffn, dispatcher=dispatcher,
                            overlap_chunks=cfg.overlap_chunks if dispatcher is not None else 1)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.moe(self.norm2(x))


class TinyPanguMoE(nn.Module):
    """Byte embedding -> ``layers`` x (MLA, MoE) blocks -> RMSNorm -> byte logits.
    ``dispatchers``: one :class:`MoEDispatcher` per layer for expert parallelism (else None)."""

    def __init__(self, cfg: Config, dispatchers: Optional[List[MoEDispatcher]] = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, None if dispatchers is None else dispatchers[i])
                                    for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, VOCAB, bias=False)
        cos, sin = rope_tables(cfg.seq_len, cfg.qk_rope_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def moe_layers(self) -> List[MoELayer]:
        return [b.moe for b in self.blocks]

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        return self.head(self.norm(x))


def _is_expert(name: str) -> bool:
    return ".moe.experts." in name


def build_model(cfg: Config, dispatchers=None, local_experts: Optional[List[torch.Tensor]] = None):
    """The model with the seed's initial weights. With dispatchers, every rank first builds the
    whole one-process model from the same seed and keeps its local experts' rows, so both runs
    start from the same weights."""
    torch.manual_seed(cfg.seed)
    full = TinyPanguMoE(cfg)
    if dispatchers is None:
        return full
    model = TinyPanguMoE(cfg, dispatchers)
    state = full.state_dict()
    E, H, F_ = cfg.experts, cfg.hidden, cfg.ffn
    for i, ids in enumerate(local_experts):
        L = ids.numel()
        p = f"blocks.{i}.moe.experts."
        state[p + "weight1"] = state[p + "weight1"].view(E, H, 2 * F_)[ids].reshape(H, L * 2 * F_)
        state[p + "weight2"] = state[p + "weight2"].view(E, F_, H)[ids].reshape(L * F_, H)
    model.load_state_dict(state)
    return model


# ----------------------------------------------------------------------------------- training
class Trainer:
    """One process's part of the run (rank ``rank`` of ``world``; world 1 = the one-process run)."""

    def __init__(self, cfg: Config, data: torch.Tensor, world: int = 1, local_size: int = 1):
        self.cfg, self.data, self.world = cfg, data, world
        check_config(cfg, world)  # again: the fields may have been changed since construction
        _checks.check_tensor("data", data, ndim=1)
        if data.numel() < cfg.seq_len + 2:
            raise ValueError(f"data has {data.numel()} tokens, fewer than seq_len + 2 "
                             f"({cfg.seq_len + 2}): each sequence is a window of seq_len + 1 tokens")
        R = cfg.ep_ranks
        self.rank = dist.get_rank() if world > 1 else 0
        self.slots = cfg.experts // R
        self.placements = [Placement.contiguous(cfg.experts, R, self.slots) for _ in range(cfg.layers)]
        if world > 1:
            self.topology = EPTopology(local_size=local_size)
            self.dispatchers = [MoEDispatcher(self.topology, cfg.experts, algorithm="hierarchical")
                                for _ in range(cfg.layers)]
            local = [torch.nonzero(p.expert_to_rank == self.rank).flatten() for p in self.placements]
            self.model = build_model(cfg, self.dispatchers, local)
        else:
            self.topology, self.dispatchers = None, None
            self.model = build_model(cfg)
        self.dense = [p for n, p in self.model.named_parameters() if not _is_expert(n)]
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.predictors = [ExpertLoadPredictor(cfg.experts, window=2 * cfg.rebalance_every,
                                               horizon=cfg.rebalance_every) for _ in range(cfg.layers)]

    def _expert_tensors(self, moe: MoELayer) -> List[torch.Tensor]:
        """``[L, ...]`` views of the layer's expert weights and their Adam moments (moved in place)."""
        ex = moe.experts
        L, H, F_ = ex.num_experts, ex.hidden_size, ex.ffn_hidden_size
        out = []
        for p, shape in ((ex.weight1, (L, H, 2 * F_)), (ex.weight2, (L, F_, H))):
            out.append(p.detach().view(shape))
            for key in ("exp_avg", "exp_avg_sq"):
                if key in self.opt.state.get(p, {}):
                    out.append(self.opt.state[p][key].view(shape))
        return out

    def step(self, step: int) -> dict:
        cfg, W = self.cfg, self.world
        t0 = _clock()
        inp, tgt = global_batch(self.data, step, cfg)
        per = cfg.batch // W
        inp, tgt = inp[self.rank * per:(self.rank + 1) * per], tgt[self.rank * per:(self.rank + 1) * per]
        n_global = cfg.batch * cfg.seq_len

        logits = self.model(inp)
        ce_sum = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tgt.reshape(-1), reduction="sum")
        level, group = ("ep_group", self.topology.group if self.topology.group is not None
                        else dist.group.WORLD) if W > 1 else ("micro_batch", None)
        aux = sum(aux_loss(m.scores, m.scores.topk(cfg.top_k, dim=-1).indices, level=level,
                           group=group, coeff=cfg.aux_coeff) for m in self.model.moe_layers())
        loss = ce_sum / n_global + aux / W
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if W > 1:  # data-parallel sum of the dense gradients (expert gradients are already whole)
            grads = [p.grad for p in self.dense]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        self.opt.step()

        counts = torch.stack([m.tokens_per_expert.to(torch.float64) for m in self.model.moe_layers()])
        scalars = torch.stack([ce_sum.detach().double(), aux.detach().double()])
        if W > 1:
            dist.all_reduce(counts)
            dist.all_reduce(scalars)
        ib = [imbalance(pl.rank_loads(c)) for pl, c in zip(self.placements, counts)]
        for pred, c in zip(self.predictors, counts):
            pred.update(c)
        moved = 0
        if (step + 1) % cfg.rebalance_every == 0:
            moved = self.rebalance()
        dt = _clock() - t0
        return dict(step=step + 1, loss=float(scalars[0]) / n_global, aux_loss=float(scalars[1]) / W,
                    imbalance=sum(ib) / len(ib), imbalance_per_layer=ib, moved_experts=moved,
                    tokens_per_s=n_global / dt, seconds=dt)

    def rebalance(self) -> int:
        """Re-plan every layer's placement from the predicted load; move the experts (multi-process).
        Returns the expert copies between ranks."""
        moved = 0
        for i, (pred, moe) in enumerate(zip(self.predictors, self.model.moe_layers())):
            new = plan_placement(pred.predict(), self.cfg.ep_ranks, self.slots, self.placements[i],
                                 max_moves=self.cfg.max_moves)
            if not new.changed:
                continue
            copies = new.moved
            new = canonical(new)  # the dispatcher's local order: each rank's experts ascending
            if self.world > 1:
                ex = PlacementExecutor(self.placements[i], self._expert_tensors(moe),
                                       dispatcher=self.dispatchers[i])
                info = ex.apply(new)
                if info["copies"] != copies:
                    raise RuntimeError(f"executor moved {info['copies']} experts, planner said {copies}")
            moved += copies
            self.placements[i] = new
        return moved


# ------------------------------------------------------------------------------------ outputs
def write_png(log: dict, path: str, compare: Optional[dict] = None) -> Optional[str]:
    """Loss (and the compared run's loss) and imbalance over steps; returns why nothing was
    written, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no PNG: {exc}"
    steps = [s["step"] for s in log["steps"]]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7.5, 6.0), sharex=True)
    a1.plot(steps, [s["loss"] for s in log["steps"]], color="#3b7dd8", lw=1.5, label=log["mode"])
    if compare is not None:
        a1.plot([s["step"] for s in compare["steps"]], [s["loss"] for s in compare["steps"]],
                color="#d8843b", lw=1, ls="--", label=compare["mode"])
    a1.set_ylabel("cross entropy (nats / byte)", fontsize=8)
    a1.legend(fontsize=8)
    a2.plot(steps, [s["imbalance"] for s in log["steps"]], color="#3b7dd8", lw=1.2)
    for s in log["steps"]:
        if s["moved_experts"]:
            a2.axvline(s["step"], color="grey", lw=0.6, ls=":")
    a2.set_ylabel(f"imbalance (max/mean - 1 of {log['config']['ep_ranks']} EP ranks)", fontsize=8)
    a2.set_xlabel("step (dotted: experts moved)", fontsize=8)
    for a in (a1, a2):
        a.tick_params(labelsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(f"Pangu-style MoE pre-training example, {log['mode']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run(cfg: Config, out: str, world: int = 1, local_size: int = 1, quiet: bool = False,
        compare: Optional[str] = None) -> dict:
    """Train (this process's part); rank 0 writes ``<out>/pretrain-<mode>.json`` and ``.png``.
    Returns the log."""
    check_config(cfg, world)  # before any work (Trainer checks again)
    data, source = corpus(cfg.corpus_bytes)
    trainer = Trainer(cfg, data, world, local_size)
    rank = trainer.rank
    mode = "1proc" if world == 1 else f"{world}proc-{world // local_size}x{local_size}"
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    if rank == 0 and not quiet:
        print(f"pretrain example: {mode}, {n_params / 1e6:.2f} M parameters, {cfg.layers} layers, "
              f"{cfg.experts} experts top-{cfg.top_k} + shared, {cfg.batch} x {cfg.seq_len} bytes per "
              f"step, corpus {source['bytes']} bytes ({source['source']})", flush=True)
    steps = []
    t_start = _clock()
    for step in range(cfg.steps):
        rec = trainer.step(step)
        steps.append(rec)
        if rank == 0 and not quiet:
            print(f"step {step + 1:4d}/{cfg.steps}  loss {rec['loss']:.4f}  aux {rec['aux_loss']:.4f}  "
                  f"imbalance {rec['imbalance']:.3f}  moved {rec['moved_experts']}  "
                  f"{rec['tokens_per_s']:,.0f} tok/s", flush=True)
    from .. import active_backend
    log = dict(mode=mode, world=world, local_size=local_size, nodes=world // local_size,
               config=dataclasses.asdict(cfg), parameters=n_params, corpus=source,
               dispatcher="hierarchical (node-deduplicated)" if world > 1 else None,
               backends={op: active_backend(op, "cpu") for op in ("mla_attention_fwd", "grouped_gemm",
                                                                  "moe_permute")},
               torch=torch.__version__, python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               seconds=_clock() - t_start, steps=steps,
               final_placements=[p.slot_to_expert.tolist() for p in trainer.placements])
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"pretrain-{mode}.json")
        with open(path, "w") as f:
            json.dump(log, f, indent=1)
        other = None
        if compare:
            with open(compare) as f:
                other = json.load(f)
        why = write_png(log, os.path.join(out, f"pretrain-{mode}.png"), other)
        if not quiet:
            print(f"wrote {path}" + (f" ({why})" if why else f" and pretrain-{mode}.png"), flush=True)
    return log


def _worker(rank: int, world: int, local_size: int, port: int, cfg: Config, out: str, quiet: bool,
            compare: Optional[str], threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(local_size))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        run(cfg, out, world, local_size, quiet, compare)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_world() -> Optional[int]:
    """The world size under torchrun (or another launcher that sets RANK / WORLD_SIZE), else None."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["WORLD_SIZE"])
    return None


def _compare_log(text: str) -> str:
    """argparse type of --compare: the path of a JSON log this script wrote (an object with ``mode``
    and ``steps``, a list of records with ``step`` and ``loss``), checked before training."""
    _cli.existing_file(text)
    try:
        with open(text) as f:
            log = json.load(f)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON log of this script: {exc}") from None
    steps = log.get("steps") if isinstance(log, dict) else None
    if (not isinstance(steps, list) or not isinstance(log.get("mode"), str)
            or not all(isinstance(r, dict) and "step" in r and "loss" in r for r in steps)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON log of this script (an object with 'mode' and "
                                         f"'steps', a list of records with 'step' and 'loss')")
    return text


def parse_args(argv=None):
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=_cli.positive_int, default=1,
                    help="gloo processes to spawn (1 = one process, no torch.distributed); under "
                    "torchrun the launcher's world is used. With more than one process the EP group is "
                    "all of them (--ep-ranks, if given, must equal --procs)")
    ap.add_argument("--local-size", type=_cli.positive_int, default=None,
                    help="ranks per emulated node (default: 2 when procs > 1, so 4 procs = 2 nodes x 2)")
    ap.add_argument("--out", default="amo-pretrain", type=_cli.output_dir, help="folder for the JSON log and the PNG")
    ap.add_argument("--compare", type=_compare_log,
                    help="a JSON log of another run whose loss the PNG overlays")
    ap.add_argument("--threads", type=_cli.positive_int, default=None, help="torch threads per process")
    ap.add_argument("--quiet", action="store_true")
    for f in dataclasses.fields(Config):
        v = getattr(d, f.name)
        if isinstance(v, int):
            kind = _cli.non_negative_int if f.name in _MAY_BE_ZERO else _cli.positive_int
        else:
            kind = _cli.non_negative_float if f.name in _MAY_BE_ZERO else _cli.positive_float
        # ep_ranks: None = not given (the default, or the process count when there are several)
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind,
                        default=None if f.name == "ep_ranks" else v)
    args = ap.parse_args(argv)
    world = _launcher_world() or args.procs
    if world > 1:
        if args.ep_ranks is not None and args.ep_ranks != world:
            ap.error(f"--ep-ranks {args.ep_ranks} conflicts with {world} processes: with more than one "
                     f"process the EP group is every process (leave --ep-ranks out)")
        args.ep_ranks = world
        local = args.local_size or (2 if world % 2 == 0 else 1)
        if world % local:
            ap.error(f"--procs {world} must be a multiple of --local-size {local}")
    elif args.ep_ranks is None:
        args.ep_ranks = d.ep_ranks
    try:
        check_config(args, world, flags=True)  # the rules Config and Trainer apply
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    if _launcher_world():  # torchrun
        world = _launcher_world()
        local = args.local_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cfg.ep_ranks = world
        dist.init_process_group("gloo")
        try:
            run(cfg, args.out, world, local, args.quiet, args.compare)
        finally:
            dist.destroy_process_group()
        return 0
    if args.procs == 1:
        if args.threads:
            torch.set_num_threads(args.threads)
        run(cfg, args.out, 1, 1, args.quiet, args.compare)
        return 0
    local = args.local_size or (2 if args.procs % 2 == 0 else 1)
    if args.procs % local:
        raise SystemExit(f"--procs {args.procs} must be a multiple of --local-size {local}")
    cfg.ep_ranks = args.procs
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.procs)
    import torch.multiprocessing as mp
    mp.start_processes(_worker, args=(args.procs, local, _free_port(), cfg, args.out, args.quiet,
                                      args.compare, threads),
                       nprocs=args.procs, start_method="spawn", join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
