"""The ring schedule every ring-style algorithm shares, on a flat ring or a double (node) ring.

A set of tensors (K,V in the forward; K,V or Q,dO,D,lse in the backward) travels around a ring:
at step t, the rank at ring position p holds the copy owned by position (p - t) mod size. The next
copy is posted before the current one is used, so transfers overlap compute (double buffering).

Optionally a gradient travels with it, one step behind: the gradient of the block owned by
position s is started at s+1 (step 1, after a warm-up compute round on the home block), accumulated
by every rank that sees the block, and after size-1 hops arrives back at s, where it is added to
s's own (step 0) contribution. Every block's gradient crosses as many links as its activations.

NCCL safety. Every step posts ONE batch per communicator in which each rank sends to its next and
receives from its previous neighbour: the activations for the next step and the gradient finished
in the previous step. All ranks post the same sequence of batches with the same shapes, so the
k-th batch of a rank always meets the k-th batch of its neighbours; no send waits for a receive
queued behind another send. (Posting a gradient send alone and its receive in a later batch -- what
gloo tolerates because it buffers -- deadlocks under NCCL once messages exceed its buffers.)
``tests/test_nccl_schedule.py`` replays every algorithm's recorded schedule under NCCL's rules.

The double ring nests this schedule: the outer ring (across nodes) carries a block to the next node,
and visiting it there is a whole inner ring (inside the node). The outer transfer of the next block
is posted before the inner ring starts, so it hides behind the inner ring's compute and intra-node
transfers; the node's summed gradient for a block then travels the outer ring one step behind.

The direct pass (:func:`direct_pass`, ``CPConfig.traffic`` "direct") sends a block only where the
mask needs it, straight from its owner, with no relaying: at step t (1 <= t < size) the member at
position p receives owner (p - t)'s tensors iff ``needs(p, p - t)`` and sends its own to p + t iff
``needs(p + t, p)``; the gradient a member computed for owner o goes straight home to o in the next
step's batch (one step behind, overlapping the next compute). Steps no member needs are skipped.
On a double ring it runs over the flat CP group (bytes still classed intra/inter per link); for a
node-aware balanced plan, over the CP group in the plan's member order (:func:`cp_ring_pass`).

NCCL safety of the direct pass. ``needs`` is the mask's (global data: the same function on every
member), so every member derives the same table and the same list of steps, and posts at most one
batch per step and communicator: the batch of step index k holds the activations for the next step
and the gradients of the previous one. A send from p to q in batch k exists iff q's receive from p
in its batch k does (both test the same ``needs`` entry), so the k-th batch of a rank only ever
meets the k-th batch of its peers; within a batch, activations precede gradients on both ends. A
member with nothing in some batch posts none (its peers expect nothing from it there). NCCL creates
a communicator at its first operation and needs every member in it: before a pass with any transfer,
every member runs ``RingComm.ensure_communicator`` (one all-reduce per group and process), so a
member that sends nothing never leaves a fresh communicator half-created.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from megatron_burst.comm import PendingExchange
from megatron_burst.masks.block import BlockMask, split_block_causal
from megatron_burst.masks.dispatch import balanced_pair_table
from megatron_burst.masks.documents import Documents, merge_rows_for
from megatron_burst.masks import vertical_slash
from megatron_burst.masks.vertical_slash import VerticalSlash, pattern_blocks
from megatron_burst.masks.visible import visible_blocks
from megatron_burst.topology import CPTopology, Ring

# gloo tags of the two rings when they share no batch (separate communicators); NCCL ignores tags
ACTIVATION_STREAM = 0
GRADIENT_STREAM = 1

TRAFFIC_KINDS = ("ring", "direct")
# kernels whose causal blocks make splitting block_causal blocks worth it (CPConfig.splits_block_causal)
DENSE_CAUSAL_OPS = ("cudnn", "cuda_flash")


@dataclass
class CPConfig:
    """Everything a CP algorithm needs besides tensors: the topology, ring shape and mask geometry."""

    topology: CPTopology
    ring: str  # "flat" | "double"
    layout: str
    stripe: int
    causal: bool
    scale: float
    # the local kernels: a KernelChoice resolved for this call (megatron_burst.kernels.choice), a
    # kernel name to force, or None (chosen per block)
    kernel: object = None
    documents: Optional[Documents] = None  # packed documents (cu_seqlens); None: one sequence
    # >1 under USP/Ulysses: each ring member holds the sequences of ``ulysses_size`` consecutive CP
    # ranks (after the all-to-all), so a block of the ring is a U x U grid of CP-rank blocks
    ulysses_size: int = 1
    window: Optional[tuple[Optional[int], Optional[int]]] = None  # sliding window (left, right); None bound = unbounded
    # a vertical-slash pattern (cp_attention(pattern=...); estimated already if dynamic), intersected
    # with ``documents`` and ``window``; ring and burst only, so ring members are CP ranks
    pattern: Optional[VerticalSlash] = None
    # has_work's table under the balanced layout, built on first use (balanced_pair_table)
    _pair_table: object = field(default=None, repr=False, compare=False)
    # how blocks travel (TRAFFIC_KINDS): "ring" (hop by hop, every block to every member unless a
    # window prunes it) or "direct" (owner to the members whose mask needs it, nothing relayed);
    # None: by layout (:attr:`resolved_traffic`)
    traffic: Optional[str] = None

    @property
    def resolved_traffic(self) -> str:
        """The traffic this call runs: :attr:`traffic` if set, else "direct" for the "balanced"
        layout (a document plan, whose block pairs are mostly empty) and "ring" for the others."""
        if self.traffic is None:
            return "direct" if self.layout == "balanced" else "ring"
        if self.traffic not in TRAFFIC_KINDS:
            raise ValueError(f"traffic={self.traffic!r}: choose one of {TRAFFIC_KINDS} (or None: by layout)")
        return self.traffic

    @property
    def prune(self) -> bool:
        """Whether rings stop circulating a block once no later member needs it. Only under a
        sliding window, where it shrinks traffic with the window; dense and document masks keep
        the full ring (their bytes do not depend on the mask). The direct pass always sends by
        the mask (:func:`direct_pass`)."""
        return self.window is not None

    @property
    def splits_block_causal(self) -> bool:
        """Whether ``block_causal`` blocks run as a ``causal`` block plus the rest of their diagonal
        stripes (:func:`~megatron_burst.masks.block.split_block_causal`): where causal blocks run a
        dense op of torch's (cuDNN or flash: nearly every pair there), i.e. on CUDA in 16 bits. Not
        where causal blocks run the same Triton kernel as block_causal ones (fp32, or the kernel
        forced): one call would become two plus a merge. Not on CPU (its fused op computes a whole
        block with one dense mask either way), nor before the kernel choice is resolved."""
        kernel = self.kernel
        if getattr(kernel, "device_type", None) != "cuda" or self.stripe <= 1:
            return False
        return kernel.get("causal", "forward") in DENSE_CAUSAL_OPS

    @property
    def merge(self) -> Optional[tuple]:
        """How adjacent document rectangles merge into one block, (merge_rows, run_rows): by the device
        of the call's kernel choice (:func:`~megatron_burst.masks.documents.merge_rows_for`; None
        when not resolved)."""
        device_type = getattr(self.kernel, "device_type", None)
        return None if device_type is None else merge_rows_for(device_type)

    @property
    def mask_kinds(self) -> tuple[str, ...]:
        """Every BlockMask kind :meth:`blocks` can yield for this configuration, on any rank (the same
        tuple everywhere: ranks agree on one kernel per kind before the first block runs)."""
        if self.pattern is not None:
            # the planner splits a plan by dense_column_for(pattern device) (through the module: tests patch it): at 0 (CUDA) every
            # visible pair is a tile column and no "gather" block exists, so asking for its kernel
            # would only choose (and warn about) the plain-torch row gather that never runs
            kinds = ("sparse",) if vertical_slash.dense_column_for(self.pattern.device) == 0 else ("sparse", "gather")
            # shared slash runs become dense positions blocks (vertical_slash.MAX_RUN_BLOCKS)
            return kinds + (("positions",) if vertical_slash.runs_apart_for(self.pattern.device) else ())
        # block-striped: block_causal blocks, and the causal + positions parts they split into on CUDA
        striped_blocks = ("block_causal", "causal", "positions") if self.layout == "striped" and self.stripe > 1 else ()
        if self.documents is not None or self.window is not None:
            return tuple(dict.fromkeys(("full", "causal") + striped_blocks + ("positions",)))
        if not self.causal:
            return ("full",)
        if self.layout == "striped":  # the diagonal block is causal; stripes of width > 1 off it
            return tuple(dict.fromkeys(("causal",) + striped_blocks))
        return ("full", "causal")

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def blocks(self, q_member: int, kv_member: int, member_len: int, q_rows: Optional[int] = None,
               split: bool = True) -> list[tuple[slice, BlockMask]]:
        """(batch slice, visible rectangle) pairs of a block pair; [] means skip it (no kernel call).

        The pair is (queries of ring member ``q_member``) x (keys of ``kv_member``), each block
        ``member_len`` tokens. Without Ulysses (``ulysses_size`` U = 1) a member is a CP rank; with
        it, a member's block is U CP-rank shards of member_len / U tokens in CP-rank order (after
        the all-to-all) and the pair is the U x U grid of shard pairs, each shifted into place.
        Document masks (``documents``) apply the same way per shard pair. ``split=False``: block_causal
        rectangles stay whole (a caller that cuts them first applies :meth:`split` itself).
        """
        U = self.ulysses_size
        if self.pattern is not None:
            if U != 1:
                raise ValueError("a sparse pattern runs on ring and burst only, not under Ulysses/USP")
            return pattern_blocks(self.pattern, self.layout, q_member, kv_member, self.world_size, member_len,
                                  self.stripe, q_rows, documents=self.documents, window=self.window)
        merge = self.merge
        if U == 1:
            out = visible_blocks(self.documents, self.layout, q_member, kv_member, self.world_size, member_len,
                                 self.causal, self.stripe, q_rows, self.window, merge)
            return self.split(out) if split else out
        if q_rows is not None:
            raise ValueError("selective row recompute (q_rows) is not available under Ulysses/USP")
        n, cp_world = member_len // U, self.world_size * U
        out = []
        for a in range(U):
            for b in range(U):
                for bs, m in visible_blocks(self.documents, self.layout, q_member * U + a, kv_member * U + b,
                                            cp_world, n, self.causal, self.stripe, window=self.window,
                                            merge=merge):
                    out.append((bs, m.shifted(a * n, b * n)))
        return self.split(out) if split else out

    def split(self, blocks: list) -> list:
        """``blocks`` with block_causal rectangles split (see :attr:`splits_block_causal`; when set)."""
        if not self.splits_block_causal or not any(m.kind == "block_causal" for _, m in blocks):
            return blocks
        return [(bs, part) for bs, m in blocks for part in split_block_causal(m)]

    def _placement_table(self) -> "np.ndarray":
        if self._pair_table is None:
            self._pair_table = balanced_pair_table(self.documents.plan, self.documents.groups, self.causal,
                                                   self.window, self.ulysses_size)
        return self._pair_table

    def member_needs(self, transpose: bool = False) -> Optional["PairNeeds"]:
        """:meth:`has_work` of every member pair as one table when it is one (the balanced layout: the
        plan's pair table), so a pass reads it whole instead of asking size² times; None otherwise
        (callers keep asking :meth:`has_work` per pair). ``transpose``: needs(holder, owner) =
        has_work(owner, holder) (burst's backward: the holder's keys meet the owner's queries)."""
        if self.documents is None or self.documents.plan is None:
            return None
        table = self._placement_table()
        return PairNeeds(table.T if transpose else table)

    def has_work(self, q_member: int, kv_member: int, member_len: int, q_rows: Optional[int] = None) -> bool:
        """Whether the pair (queries of ``q_member``) x (keys of ``kv_member``) may have a visible
        pair: what a pruned ring (:attr:`prune`, :func:`ring_pass`'s ``needs``) asks of every pair
        on every rank. Exactly ``bool(blocks(...))``, except under a sparse pattern: there the
        dense mask the pattern is intersected with (causal, documents, window), a superset
        computed on the host, so that no rank plans all W x W pairs to prune its ring (a pair
        it says True for may still have nothing visible: it is then visited for nothing). Under
        the balanced layout it reads one table per call built from the plan's runs
        (:func:`~megatron_burst.masks.dispatch.balanced_pair_table`: exact for documents, a superset under a window or with
        ``q_rows``), not W x W block lists."""
        if self.documents is not None and self.documents.plan is not None:  # balanced: from the plan's runs
            return bool(self._placement_table()[q_member][kv_member])
        if self.pattern is None:
            return bool(self.blocks(q_member, kv_member, member_len, q_rows))
        return bool(visible_blocks(self.documents, self.layout, q_member, kv_member, self.world_size, member_len,
                                   True, self.stripe, q_rows, self.window))


Visit = Callable[[int, Sequence[torch.Tensor]], Optional[torch.Tensor]]
Needs = Callable[[int, int], bool]  # needs(holder, owner): the holder has work on the owner's block


class PairNeeds:
    """A :data:`Needs` read from a table: ``needs(holder, owner) = matrix[holder, owner]`` (bool [size, size]).

    Where every pair's answer is already a table (the balanced plan's pair table), the passes read it
    whole (:func:`needs_table`, :func:`last_steps`) in one array operation instead of size² Python
    calls (~1-3 ms per pass at size 64); it stays callable for code that asks pair by pair."""

    def __init__(self, matrix: np.ndarray) -> None:
        matrix = np.asarray(matrix)
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.dtype != np.bool_:
            raise ValueError(f"PairNeeds takes a square bool matrix [size, size], got {matrix.dtype} "
                             f"{tuple(matrix.shape)}")
        self.matrix = matrix

    def __call__(self, holder: int, owner: int) -> bool:
        return bool(self.matrix[holder, owner])

    def reordered(self, order: Sequence[int]) -> "PairNeeds":
        """The table over positions p where position p is member ``order[p]``: ``needs(order[h], order[o])``."""
        idx = np.asarray(order, dtype=np.int64)
        return PairNeeds(self.matrix[np.ix_(idx, idx)])

    def checked(self, size: int) -> np.ndarray:
        """The matrix, after checking it covers a ring of ``size`` members (ValueError otherwise)."""
        if self.matrix.shape != (size, size):
            raise ValueError(f"a needs table of shape {self.matrix.shape} cannot serve a ring of {size} members")
        return self.matrix


class _StepExchange:
    """One step's posted transfers: activations for the next step, and gradient blocks (one sent
    at most; received: the previous member's partial sum and/or this member's finished block).

    Peers are ring positions: gradients name theirs; activations go to ``act_to`` and come from
    ``act_from`` (default: the next and previous member, the ring's hop)."""

    def __init__(self, ring: Ring, activations: Sequence[torch.Tensor], act_like: Sequence[torch.Tensor],
                 grad_send: Optional[tuple[torch.Tensor, int]], grad_recv: Sequence[tuple[torch.Tensor, int]],
                 phase: str, label: str, act_to: Optional[int] = None, act_from: Optional[int] = None) -> None:
        comm = ring.act
        act_to_rank = comm.next if act_to is None else comm.ring[act_to]
        act_from_rank = comm.prev if act_from is None else comm.ring[act_from]
        act_recv = [torch.empty_like(t) for t in act_like]
        g_send = [] if grad_send is None else [grad_send[0]]
        g_peer = lambda p: ring.grad.ring[p]  # noqa: E731
        g_to = [] if grad_send is None else [g_peer(grad_send[1])]
        g_recv = [torch.empty_like(t) for t, _ in grad_recv]
        g_from = [g_peer(p) for _, p in grad_recv]
        self._n_act = len(act_recv)
        a_to, a_from = [act_to_rank] * len(activations), [act_from_rank] * len(act_recv)
        if ring.act is ring.grad:  # one communicator: one batch for both
            both = comm.exchange(list(activations) + g_send, act_recv + g_recv, phase, send_to=a_to + g_to,
                                 recv_from=a_from + g_from, label=label)
            self._act: PendingExchange = both
            self._grad: PendingExchange = both
        else:
            self._act = comm.exchange(activations, act_recv, phase, send_to=a_to, recv_from=a_from,
                                      stream=ACTIVATION_STREAM, label=label + " act")
            self._grad = ring.grad.exchange(g_send, g_recv, phase, send_to=g_to, recv_from=g_from,
                                            stream=GRADIENT_STREAM, label=label + " grad")

    def activations(self) -> list[torch.Tensor]:
        return self._act.wait()[:self._n_act]

    def gradients(self) -> list[torch.Tensor]:
        got = self._grad.wait()
        return got[self._n_act:] if self._grad is self._act else got

    def wait(self) -> None:
        self._act.wait()
        self._grad.wait()


def last_steps(size: int, needs: Optional[Needs]) -> list[int]:
    """Per owner position o: the last ring step whose holder (o + step) needs o's block (0 if none;
    size - 1 for every owner without ``needs``: the full ring). The same list on every member."""
    if needs is None:
        return [size - 1] * size
    if isinstance(needs, PairNeeds):  # hit[t, o] = needs((o + t) % size, o): the last t with a hit per column
        hit = _by_step(needs.checked(size))
        hit[0] = False  # step 0 is the owner's own visit, not a transfer
        return np.where(hit.any(axis=0), size - 1 - np.argmax(hit[::-1], axis=0), 0).tolist()
    return [max((t for t in range(1, size) if needs((o + t) % size, o)), default=0) for o in range(size)]


def _by_step(table: np.ndarray) -> np.ndarray:
    """bool [size, size]: [t, o] = table[(o + t) % size, o] (the holder t positions after owner o)."""
    size = table.shape[0]
    o = np.arange(size)
    return table[(o[None, :] + o[:, None]) % size, o[None, :]]


def ring_pass(ring: Optional[Ring], travel: Sequence[torch.Tensor], visit: Visit, phase: str,
              grad_like: Optional[torch.Tensor] = None, needs: Optional[Needs] = None) -> Optional[torch.Tensor]:
    """Circulate ``travel`` around ``ring`` (None = a single rank) calling ``visit(owner_pos, tensors)``.

    Without ``grad_like`` the visits' return values are ignored and None is returned. With it
    (a tensor giving the travelling gradient's shape and dtype), ``visit`` returns a fresh tensor,
    the gradient contribution for the owner's block (same shape as ``grad_like``); the
    contributions are summed around the ring and the total for this rank's own block is returned.

    ``needs(holder_pos, owner_pos)`` (a sliding window): a block travels only as far as the last
    member that needs it (members before that relay it; ``visit`` is called only while a member
    holds it), and its gradient goes home from there in one message. Every member derives the
    same per-owner last steps (:func:`last_steps`), so the batches of neighbours still match.
    """
    size, pos = (ring.size, ring.pos) if ring is not None else (1, 0)
    last = last_steps(size, needs)
    T = max(last)
    travel = list(travel)
    like = list(travel)
    with_grad = grad_like is not None
    home_grad: Optional[torch.Tensor] = None
    finished: Optional[tuple[torch.Tensor, int]] = None  # (gradient accumulated last step, its owner)
    for step in range(T + 1 + (1 if with_grad and T >= 1 else 0)):
        owner = (pos - step) % size
        holding = step <= last[owner]  # (false in the final, gradient-only step)
        act_out = travel if holding and step < last[owner] else []
        act_in = like if step < last[(pos - 1 - step) % size] else []
        grad_send = None
        if finished is not None:
            g, of = finished
            grad_send = (g, (pos + 1) % size if step <= last[of] else of)  # on to the next holder, or home
        grad_recv = []
        if with_grad and holding and step >= 2:  # the previous holder's sum for this owner's block
            grad_recv.append((grad_like, (pos - 1) % size))
        home = with_grad and last[pos] >= 1 and step == last[pos] + 1
        if home:  # this member's block, summed by every holder
            grad_recv.append((grad_like, (pos + last[pos]) % size))
        posted = None
        if act_out or act_in or grad_send is not None or grad_recv:
            label = f"{phase} gradient home" if step > T else f"{phase} step {step}"
            posted = _StepExchange(ring, act_out, act_in, grad_send, grad_recv, phase, label)
        finished = None
        if holding:
            contribution = visit(owner, travel)
            if with_grad:
                if step == 0:
                    home_grad = contribution
                else:
                    if step >= 2:
                        contribution.add_(posted.gradients()[0])
                    finished = (contribution, owner)
        if posted is not None:
            if act_in:
                travel = posted.activations()
            if home:
                home_grad.add_(posted.gradients()[-1])
            posted.wait()
    return home_grad


def needs_table(size: int, needs: Needs) -> np.ndarray:
    """bool [size, size]: ``table[holder][owner]`` = ``needs(holder, owner)`` for every pair of distinct
    positions (the diagonal is False: a member's own block never travels). The same table on every
    member. A :class:`PairNeeds` is copied in one operation; any other callable is asked per pair."""
    if isinstance(needs, PairNeeds):
        table = needs.checked(size).copy()
    else:
        table = np.array([[bool(needs(h, o)) for o in range(size)] for h in range(size)], dtype=bool)
        table = table.reshape(size, size)  # size 0 would otherwise give shape (0,)
    np.fill_diagonal(table, False)
    return table


def direct_steps(table: Sequence[Sequence[bool]]) -> list[int]:
    """The steps t in 1..size-1 at which some holder needs the block of the owner t positions
    before it (``table`` from :func:`needs_table`); the others are skipped by every member."""
    table = np.asarray(table, dtype=bool)
    if table.size == 0:
        return []
    return [t for t in np.flatnonzero(_by_step(table).any(axis=1)).tolist() if t >= 1]


def direct_pass(ring: Optional[Ring], travel: Sequence[torch.Tensor], visit: Visit, phase: str,
                grad_like: Optional[torch.Tensor] = None, needs: Optional[Needs] = None) -> Optional[torch.Tensor]:
    """:func:`ring_pass`'s contract (``visit(owner_pos, tensors)``, an optional gradient summed back
    to its owner, this member's own gradient returned) with traffic that follows the mask.

    ``needs(holder_pos, owner_pos)`` is required: at step t the member at position p gets the
    tensors of owner (p - t) straight from it iff ``needs(p, p - t)`` and visits them; nothing is
    relayed. A gradient contribution goes straight home in the next step's batch. Steps nobody
    needs are skipped (:func:`direct_steps`); NCCL safety: module docstring. Live travelling
    buffers are the ring's: the block being visited and the one arriving; the gradient being
    computed, the one going home and the one arriving home.
    """
    if needs is None:
        raise ValueError("direct_pass needs needs(holder, owner): the table of which members visit whose block")
    size, pos = (ring.size, ring.pos) if ring is not None else (1, 0)
    table = needs_table(size, needs)
    steps = [0] + direct_steps(table)  # step 0: the own block, no transfer
    if len(steps) > 1:  # some member posts transfers while others may post none: NCCL needs the
        # communicator created with everyone present first (the table, hence this branch, is global)
        ring.act.ensure_communicator()
        if ring.grad is not ring.act and grad_like is not None:
            ring.grad.ensure_communicator()
    own = list(travel)
    with_grad = grad_like is not None
    home_grad: Optional[torch.Tensor] = None
    held: Optional[list[torch.Tensor]] = own  # what this member visits at the current step (None: nothing)
    finished: Optional[tuple[torch.Tensor, int]] = None  # (gradient computed at the previous step, its owner)
    # one iteration per step, and with a gradient one more: the last step's gradients going home
    rounds = len(steps) + (1 if with_grad and len(steps) > 1 else 0)
    for k in range(rounds):
        step = steps[k] if k < len(steps) else None
        upcoming = steps[k + 1] if k + 1 < len(steps) else None
        act_out: list[torch.Tensor] = []
        act_in: list[torch.Tensor] = []
        act_to = act_from = None
        if upcoming is not None:
            act_to, act_from = (pos + upcoming) % size, (pos - upcoming) % size
            if table[act_to][pos]:
                act_out = own
            if table[pos][act_from]:
                act_in = own  # shapes and dtypes of the owner's tensors: the same on every member
        grad_recv = []
        if with_grad and k >= 2:  # the previous step's holder of this member's block sends its gradient home
            previous_holder = (pos + steps[k - 1]) % size
            if table[previous_holder][pos]:
                grad_recv.append((grad_like, previous_holder))
        posted = None
        if act_out or act_in or finished is not None or grad_recv:
            label = f"{phase} direct gradient home" if step is None else f"{phase} direct step {step}"
            posted = _StepExchange(ring, act_out, act_in, finished, grad_recv, phase, label, act_to, act_from)
        finished = None
        if step is not None and held is not None:
            owner = (pos - step) % size
            contribution = visit(owner, held)
            if with_grad:
                if step == 0:
                    home_grad = contribution
                else:
                    finished = (contribution, owner)
        held = None
        if posted is not None:
            if act_in:
                held = posted.activations()
            if grad_recv:
                home_grad.add_(posted.gradients()[0])
            posted.wait()
    return home_grad


def _plan_member_order(cfg: CPConfig) -> Optional[tuple]:
    """The balanced plan's member order when the direct pass must follow it (a node-aware placement:
    not the identity; ring members are CP ranks, i.e. no Ulysses), else None."""
    plan = cfg.documents.plan if cfg.documents is not None else None
    if plan is None or cfg.ulysses_size != 1 or cfg.world_size == 1:
        return None
    order = plan.member_order
    return None if order == tuple(range(len(order))) else order


def cp_ring_pass(cfg: CPConfig, travel: Sequence[torch.Tensor], visit: Visit, phase: str,
                 grad_like: Optional[torch.Tensor] = None, needs: Optional[Needs] = None) -> Optional[torch.Tensor]:
    """:func:`ring_pass` over the CP group in ``cfg.ring``'s shape; ``visit`` gets owner CP ranks
    (ring members under Ulysses/USP). ``needs(holder, owner)`` on the same ranks prunes the ring
    (used only when ``cfg.prune``); on the double ring a node's blocks travel the outer ring as
    far as the last node with a rank that needs one, the inner rings prune per block.

    With ``cfg.resolved_traffic`` "direct" it is :func:`direct_pass` over the flat CP group
    (whatever ``cfg.ring``), sending by ``needs`` always; ``needs`` is then required. When the
    documents' balanced plan is placed over several nodes (``plan.member_order`` not the identity;
    without Ulysses), the pass runs over the CP group in the plan's member order: ring position p
    is CP rank ``member_order[p]``, so step t pairs the plan positions the planner balanced at step
    t (its ``work``); ``visit`` and ``needs`` still get CP ranks. Every rank derives the order from
    the same plan, so every rank runs the same table and steps (NCCL-safe as :func:`direct_pass`)."""
    topo = cfg.topology
    if cfg.resolved_traffic == "direct":
        if needs is None:
            raise ValueError("traffic='direct' sends blocks by the mask: cp_ring_pass needs needs(holder, owner)")
        order = _plan_member_order(cfg)
        if order is None:
            return direct_pass(topo.flat, travel, visit, phase, grad_like, needs)
        in_order = (needs.reordered(order) if isinstance(needs, PairNeeds)
                    else lambda holder, owner: needs(order[holder], order[owner]))
        return direct_pass(topo.ring_in_order(order), travel, lambda pos, t: visit(order[pos], t), phase, grad_like,
                           in_order)
    needs = needs if cfg.prune else None
    if cfg.ring == "flat" or topo.num_nodes == 1:
        return ring_pass(topo.flat, travel, visit, phase, grad_like, needs)
    R = topo.ranks_per_node
    my_node = topo.node_of(topo.rank)

    def visit_node(owner_node: int, tensors: Sequence[torch.Tensor]):
        inner_needs = None if needs is None else (lambda h, o: needs(my_node * R + h, owner_node * R + o))
        return ring_pass(topo.inner, tensors, lambda owner_local, t: visit(owner_node * R + owner_local, t),
                         phase, grad_like, inner_needs)

    node_needs = None if needs is None else (
        lambda hn, on: any(needs(hn * R + a, on * R + b) for a in range(R) for b in range(R)))
    return ring_pass(topo.outer, travel, visit_node, phase, grad_like, node_needs)
