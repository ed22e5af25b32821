"""Calls into flash-linear-attention's chunk kernels for one rank's segments (the local work of
LASP-2 / LASP-1 and of the CP gated delta rule); the exchange between ranks stays ours.

Layouts. Our ops hold a rank's s local tokens as ``nseg`` segments of L consecutive global
positions (:mod:`megatron_burst.linear.checks`). fla's kernels take rows ``[N, T, H, d]`` (each row
an independent causal sequence). :func:`to_rows` makes every (segment, sample) a row, segment-major:
row ``i * b + j`` is segment i of sample j, so ``N = nseg * b`` and ``T = L``. fla is causal within
a row and includes the current token, exactly as our segments' zero-start outputs.

Which fla family computes which decay form (all take natural-log decays, <= 0; fla rescales them
to base 2 inside):

=========  ==========================  =====================================================
decay      our g                       fla call
=========  ==========================  =====================================================
none       None                        ``chunk_simple_gla(q, k, v)`` (no g, no g_gamma)
head       [h]                         ``chunk_simple_gla(..., g_gamma=g)``; when g needs a
                                       gradient, ``g=`` the same value per token [N, L, h]
                                       (fla returns no gradient for ``g_gamma``)
token      [s, b, h]                   ``chunk_simple_gla(..., g=[N, L, h])``
channel    [s, b, h, dk]               ``chunk_gla(..., g=[N, L, h, dk])``
gdn        g, beta [s, b, h]           ``chunk_gated_delta_rule(...)``; several segments: at
                                       value width dv + dk, entering [0 | I] (:func:`gdn_terms`)
=========  ==========================  =====================================================

Scale: fla's ``o = scale * q S`` with S including the current token -- ours; we always pass the
op's scale explicitly (fla's default is also dk ** -0.5, but an explicit value cannot drift).
Final states come back as [N, h, dk, dv] (fla's default ``state_v_first=False``); we use them as
the segments' zero-start states M, differentiable (fla's backward takes their gradient ``dht``).

Documents. A document start inside a row cuts it into *pieces* (runs of consecutive positions in
one document; a row starts a piece too). fla's varlen mode takes exactly that: the rows flattened
to batch 1, [1, N * L, h, d], with ``cu_seqlens`` [P + 1] the piece boundaries (every piece its own
sequence, entering with ``initial_state[p]``, leaving ``final_state[p]``). :func:`row_pieces` builds
them from the global boundaries (:class:`RowPieces`, cached per batch and layout). What our
algorithms need per segment then comes from the pieces:

* LASP-2: a segment's zero-start output is every piece's output from a zero state (a piece never
  sees an earlier document), and its M -- the state it leaves, keeping its last document only --
  is the final state of its last piece (``RowPieces.last``). The entering state's term and the
  reset flags of the exchange stay as the torch path forms them (:mod:`megatron_burst.linear.docs`).
* gated delta rule: a row's entering state reaches its first piece only, and only when no
  document starts at the row's first token (``RowPieces.carried``); every other piece starts from
  zero (its document starts inside the row). So the identity of :func:`gdn_terms` enters the
  carried first pieces, and a row's map and state are its last piece's.

The gated delta rule's maps (:func:`gdn_terms`). The recurrence acts on the state's value columns
one by one, linearly: S_t[:, c] = A_t S_in[:, c] + (the zero-start state's column c). So dk extra
value columns, whose values are zero and which enter as the identity, carry A_t itself: their final
state is the row's map A, and their output scale * A_t^T q_t is the row the entering state
multiplies (o_t = o0_t + o_in_t S_in). One fla call at value width dv + dk thus gives the zero-start
outputs, the rows o_in and the maps (A, B) that the CP exchange composes -- fla's kernels and its
backward for all of them, nothing of the chunk algebra in torch. Under documents the identity
enters the carried first pieces only, so a row in which a document starts ends with A = 0.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from megatron_burst.linear.chunked import entering_term
from megatron_burst.masks.documents import Documents

# fla's GLA kernel asserts an fp32 initial state; our exchanged states are fp32 anyway
STATE_DTYPE = torch.float32


@dataclass(frozen=True)
class RowPieces:
    """The pieces of one rank's fla rows under documents (see the module docstring). Rows are
    segment-major (row i * b + j: local segment i of sample j), each L tokens, flattened to one
    sequence of N * L tokens; P pieces in flattened order.

    ``cu_seqlens`` [P + 1] (int64, on the rows' device): piece boundaries in the flattened sequence,
    as fla's varlen kernels take them; ``cu_seqlens_cpu`` the same on the host (fla sizes its
    launch grid from it without reading the device tensor back). ``last`` [N] (int64, device): each
    row's last piece. ``row`` [P] (int64, device): each piece's row. ``carried`` [P] (fp32, device):
    1 for a row's first piece when the row's first token continues the document of the token
    before the segment (the entering state reaches it), else 0.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    last: torch.Tensor
    row: torch.Tensor
    carried: torch.Tensor

    @property
    def count(self) -> int:
        """P, the number of pieces (fla's number of sequences)."""
        return self.cu_seqlens_cpu.numel() - 1


def _sample_bounds(documents: Documents, batch: int) -> list[tuple[int, ...]]:
    """The boundaries [0, ..., S] of every sample (documents validated for ``batch`` samples)."""
    out: list[Optional[tuple[int, ...]]] = [None] * batch
    for first, end, bounds in documents.groups:
        for j in range(first, end):
            out[j] = bounds
    missing = [j for j, x in enumerate(out) if x is None]
    if missing:
        raise ValueError(f"documents give no boundaries for samples {missing} of a batch of {batch}: pass "
                         "cu_seqlens for every sample")
    return out  # type: ignore[return-value]


@functools.lru_cache(maxsize=16)  # a step's layers share one batch's pieces; a new batch makes new ones
def _pieces(documents: Documents, batch: int, segments: tuple, device: str) -> RowPieces:
    per_sample = _sample_bounds(documents, batch)
    cuts: list[int] = []
    last: list[int] = []
    row: list[int] = []
    carried: list[float] = []
    offset = 0  # the row's first token in the flattened sequence
    for i, (lo, length) in enumerate(segments):  # segment-major rows: row i * b + j
        hi = lo + length
        for j in range(batch):
            bounds = per_sample[j]
            # document starts strictly inside the segment cut it; one at its first token starts
            # the row's first piece afresh (no entering state), as does the sequence start
            inside = bounds[bisect.bisect_right(bounds, lo):bisect.bisect_left(bounds, hi)]
            starts = [offset] + [offset + x - lo for x in inside]
            cuts += starts
            row += [i * batch + j] * len(starts)
            carried += [0.0 if lo in bounds else 1.0] + [0.0] * len(inside)
            last.append(len(cuts) - 1)
            offset += length
    cuts.append(offset)
    cpu = torch.tensor(cuts, dtype=torch.int64)
    return RowPieces(cu_seqlens=cpu.to(device), cu_seqlens_cpu=cpu,
                     last=torch.tensor(last, dtype=torch.int64, device=device),
                     row=torch.tensor(row, dtype=torch.int64, device=device),
                     carried=torch.tensor(carried, dtype=STATE_DTYPE, device=device))


def row_pieces(documents: Optional[Documents], batch: int, order: tuple[int, ...], total: int,
               device: torch.device) -> Optional[RowPieces]:
    """The :class:`RowPieces` of a rank's rows (its local segments ``order``: global indices in
    local order, out of ``total`` equal global segments; ``batch`` samples); None without documents.
    Cached: every layer of a step gets the same tensors (fla caches its chunk indices per
    ``cu_seqlens`` tensor)."""
    if documents is None:
        return None
    L = documents.seq_len // total
    return _pieces(documents, batch, tuple((gi * L, L) for gi in order), str(device))


def run_pieces(documents: Documents, batch: int, runs: tuple[tuple[int, int], ...], device: torch.device) -> RowPieces:
    """The :class:`RowPieces` of a rank's runs (THD, balanced: :mod:`megatron_burst.linear.runs`):
    ``runs`` = ((global start, length), ...) in local order, rows run-major as
    :meth:`megatron_burst.linear.runs.RunLayout.to_flat` lays them out (cached)."""
    return _pieces(documents, batch, tuple(runs), str(device))


def decay_flat(g: Optional[torch.Tensor], form: str, flatten: Callable[[torch.Tensor], torch.Tensor], tokens: int
               ) -> Optional[torch.Tensor]:
    """:func:`decay_rows` for runs: fla's ``g`` for varlen rows of ``tokens`` tokens in all, laid out
    by ``flatten`` (:meth:`megatron_burst.linear.runs.RunLayout.to_flat`); None for "none" and for a
    per-head decay passed as ``g_gamma``."""
    if form == "none" or (form == "head" and not g.requires_grad):
        return None
    if form == "head":  # the same decay for every token: autograd sums fla's per-token dg back to [h]
        return g.float().view(1, 1, -1).expand(1, tokens, g.shape[0])
    return flatten(g.float())


def flatten_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows [N, L, ...] -> one sequence [1, N * L, ...] (fla's varlen input: batch 1)."""
    return t.reshape((1, t.shape[0] * t.shape[1]) + tuple(t.shape[2:]))


def _varlen(pieces: Optional[RowPieces]) -> dict:
    """fla's varlen keyword arguments for ``pieces`` (none without documents)."""
    if pieces is None:
        return {}
    return {"cu_seqlens": pieces.cu_seqlens, "cu_seqlens_cpu": pieces.cu_seqlens_cpu}


def _fla_name(fla_fn: Callable) -> str:
    return f"{getattr(fla_fn, '__module__', '?')}.{getattr(fla_fn, '__name__', fla_fn)}"


def to_rows(t: torch.Tensor, nseg: int, sbhd: bool) -> torch.Tensor:
    """A rank-local tensor [s, b, h, ...] (``sbhd``) or [b, s, h, ...] -> fla rows [nseg * b, L, h, ...]
    (segment-major: row i * b + j is segment i of sample j; L = s / nseg)."""
    t = t.transpose(0, 1) if sbhd else t  # [b, s, ...]
    if nseg == 1:  # the rows are the samples: no reshapes (each one is an autograd node, host time per layer)
        return t
    b, s = t.shape[0], t.shape[1]
    rest = tuple(t.shape[2:])
    return t.reshape((b, nseg, s // nseg) + rest).transpose(0, 1).reshape((nseg * b, s // nseg) + rest)


def rows_to_segments(o: torch.Tensor, nseg: int) -> torch.Tensor:
    """fla rows [nseg * b, L, h, d] -> our segment layout [nseg, b, h, L, d]."""
    n, L, h, d = o.shape
    return o.reshape(nseg, n // nseg, L, h, d).permute(0, 1, 3, 2, 4)


def rows_to_local(o: torch.Tensor, nseg: int, sbhd: bool) -> torch.Tensor:
    """fla rows [nseg * b, L, h, d] -> the rank-local layout [s, b, h, d] (``sbhd``) or [b, s, h, d]."""
    if nseg == 1:
        return o.transpose(0, 1) if sbhd else o
    n, L, h, d = o.shape
    b = n // nseg
    o = o.reshape(nseg, b, L, h, d).transpose(0, 1).reshape(b, nseg * L, h, d)
    return o.transpose(0, 1) if sbhd else o


def one_rank(run: Callable[[list, Optional[RowPieces]], torch.Tensor], tensors: tuple, documents: Optional[Documents],
             sbhd: bool) -> torch.Tensor:
    """The op at W = 1 by one fla call: a rank of a world of one holds the whole sequence in order
    whatever the layout (zigzag's two segments and the stripes are consecutive there), so it runs
    from a zero state exactly as fla's own user calls it. ``tensors`` (q first) in the rank-local
    layout [s, b, h, ...] (``sbhd``) or [b, s, h, ...]; ``run(rows, pieces)`` gets them as rows
    [b, s, h, ...] (views) and the documents' pieces (None without) and returns fla's output rows
    [b, s, h, dv]; returned in the local layout, in q's dtype."""
    q = tensors[0]
    pieces = row_pieces(documents, q.shape[1] if sbhd else q.shape[0], (0,), 1, q.device)
    o = run([to_rows(t, 1, sbhd) for t in tensors], pieces)
    return rows_to_local(o, 1, sbhd).to(q.dtype).contiguous()


def decay_rows(g: Optional[torch.Tensor], form: str, nseg: int, b: int, L: int, sbhd: bool) -> Optional[torch.Tensor]:
    """Our log-decay in ``form`` -> what fla's ``g`` argument takes (fp32): None for "none" and for a
    per-head decay passed as ``g_gamma``; [N, L, h] for "token" (and "head" needing a gradient);
    [N, L, h, dk] for "channel". ``g`` [s, b, h(, dk)] is in sbhd order when ``sbhd`` (else [b, s, ...])."""
    if form == "none":
        return None
    if form == "head":
        if not g.requires_grad:
            return None
        # the same decay for every token: autograd sums fla's per-token dg back to [h]
        return g.float().view(1, 1, -1).expand(nseg * b, L, g.shape[0])
    return to_rows(g.float(), nseg, sbhd)


def lasp2_segments(fla_fn: Callable, form: str, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                   g: Optional[torch.Tensor], g_rows: Optional[torch.Tensor], scale: float,
                   pieces: Optional[RowPieces] = None, final_state: bool = True
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(o, M) of every segment by fla: o [N, L, h, dv] (q's dtype) the output from a zero entering
    state, M [N, h, dk, dv] (fp32) the state the segment leaves (None with ``final_state=False``: fla
    then neither writes the states nor reads their zero gradient back). ``fla_fn``: ``chunk_simple_gla``
    for forms none / head / token, ``chunk_gla`` for "channel"; ``g`` our decay as given (used for
    the per-head ``g_gamma``), ``g_rows`` from :func:`decay_rows`. ``pieces`` (documents): the rows
    run as their pieces, each from a zero state; M is then each row's last piece's final state."""
    N, L = q_rows.shape[0], q_rows.shape[1]
    if pieces is not None:
        q_rows, k_rows, v_rows = (flatten_rows(t) for t in (q_rows, k_rows, v_rows))
        g_rows = None if g_rows is None else flatten_rows(g_rows)
    varlen = _varlen(pieces)
    if form == "channel":
        o, M = fla_fn(q_rows, k_rows, v_rows, g_rows, scale=scale, initial_state=None, output_final_state=final_state,
                      **varlen)
    elif form == "head" and g_rows is None:
        o, M = fla_fn(q_rows, k_rows, v_rows, g=None, g_gamma=g.float(), scale=scale, initial_state=None,
                      output_final_state=final_state, **varlen)
    else:
        o, M = fla_fn(q_rows, k_rows, v_rows, g=g_rows, scale=scale, initial_state=None,
                      output_final_state=final_state, **varlen)
    if pieces is not None:
        o = o.reshape((N, L) + tuple(o.shape[2:]))
    if not final_state:
        return o, None
    if M is None:
        raise RuntimeError(f"{_fla_name(fla_fn)} returned no final state with output_final_state=True: LASP needs "
                           "each segment's state")
    if pieces is not None:
        if M.shape[0] != pieces.count:
            raise RuntimeError(f"{_fla_name(fla_fn)} returned {M.shape[0]} final states for {pieces.count} sequences "
                               "(cu_seqlens): its varlen mode does not work as fla 0.6 documents it")
        M = M[pieces.last]  # the state a segment leaves keeps its last document: its last piece's
    return o, M.to(STATE_DTYPE)


def gdn_rows(fla_fn: Callable, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
             g_rows: torch.Tensor, beta_rows: torch.Tensor, scale: float,
             pieces: Optional[RowPieces] = None) -> torch.Tensor:
    """Outputs [N, L, h, dv] (q's dtype) of fla's ``chunk_gated_delta_rule`` on rows [N, L, h, d]
    entering with a zero state. g fp32 log-decay, beta [N, L, h]. ``pieces`` (documents): the rows
    run as their pieces, each from a zero state."""
    N, L = q_rows.shape[0], q_rows.shape[1]
    if pieces is not None:
        q_rows, k_rows, v_rows, g_rows, beta_rows = (flatten_rows(t) for t in (q_rows, k_rows, v_rows, g_rows,
                                                                                beta_rows))
    o, _ = fla_fn(q_rows, k_rows, v_rows, g_rows.float(), beta_rows, scale=scale, initial_state=None,
                  output_final_state=False, **_varlen(pieces))
    return o.reshape((N, L) + tuple(o.shape[2:]))


class GdnTerms(NamedTuple):
    """What one rank's rows contribute to the CP gated delta rule (see the module docstring): an
    entering state S_in [N, h, dk, dv] gives the outputs ``o0 + o_in @ S_in`` (per token, per head)
    and leaves ``A @ S_in + B``."""

    o0: torch.Tensor  # [N, L, h, dv] (q's dtype): the outputs from a zero entering state
    o_in: torch.Tensor  # [N, L, h, dk] (q's dtype): scale * A_t^T q_t, the map from S_in to the outputs
    A: torch.Tensor  # [N, h, dk, dk] fp32: the row's map of the entering state (0 where a document starts)
    B: torch.Tensor  # [N, h, dk, dv] fp32: the state the row leaves from a zero start


def gdn_terms(fla_fn: Callable, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
              g_rows: torch.Tensor, beta_rows: torch.Tensor, scale: float,
              pieces: Optional[RowPieces] = None) -> GdnTerms:
    """:class:`GdnTerms` of rows [N, L, h, d] by one call of fla's ``chunk_gated_delta_rule`` at value
    width dv + dk (the identity trick of the module docstring). g fp32 log-decay, beta [N, L, h].
    ``pieces`` (documents): the rows run as their pieces; the identity enters each row's first piece
    when that continues the entering document (``pieces.carried``), a zero state every other piece;
    A and B are each row's last piece's. Differentiable in every input through fla's backward (its
    gradients of the outputs and of the final states)."""
    N, L, h, dk = k_rows.shape
    dv = v_rows.shape[-1]
    if pieces is not None:
        q_rows, k_rows, v_rows, g_rows, beta_rows = (flatten_rows(t) for t in (q_rows, k_rows, v_rows, g_rows,
                                                                                beta_rows))
    count = N if pieces is None else pieces.count
    v_wide = torch.cat([v_rows, v_rows.new_zeros(tuple(v_rows.shape[:-1]) + (dk,))], dim=-1)
    eye = torch.eye(dk, dtype=STATE_DTYPE, device=k_rows.device).expand(count, h, dk, dk)
    if pieces is not None:
        eye = eye * pieces.carried.view(-1, 1, 1, 1)
    init = torch.cat([eye.new_zeros(count, h, dk, dv), eye], dim=-1)  # [count, h, dk, dv + dk]
    o, final = fla_fn(q_rows, k_rows, v_wide, g_rows.float(), beta_rows, scale=scale, initial_state=init,
                      output_final_state=True, **_varlen(pieces))
    if final is None or tuple(final.shape) != (count, h, dk, dv + dk):
        got = None if final is None else tuple(final.shape)
        raise RuntimeError(f"{_fla_name(fla_fn)} returned final states {got}, expected {(count, h, dk, dv + dk)} "
                           "with output_final_state=True: the CP gated delta rule needs every row's map")
    if pieces is not None:
        o = o.reshape((N, L) + tuple(o.shape[2:]))
        final = final[pieces.last]  # a row's map and state are its last piece's
    final = final.to(STATE_DTYPE)
    return GdnTerms(o[..., :dv], o[..., dv:], final[..., dv:], final[..., :dv])


def add_entering(terms: GdnTerms, S_in: torch.Tensor) -> torch.Tensor:
    """The outputs [N, L, h, dv] (fp32) of rows entering with S_in [N, h, dk, dv] (fp32):
    o0 + o_in @ S_in, token by token."""
    corr = entering_term(terms.o_in.transpose(1, 2), S_in)  # [N, h, L, dv]; keeps a copy of o_in, not the wide output
    return terms.o0 + corr.transpose(1, 2)  # fp32: the fp32 term promotes o0 (no fp32 copy of it)
