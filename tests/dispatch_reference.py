"""A frozen copy of the balanced dispatch planner as it was before its speed-up (issue L: <= 5 ms
for 1M tokens, 1000 documents, W = 64), kept as the baseline: tests/test_dispatch.py checks that
:func:`megatron_burst.masks.dispatch.plan_dispatch` is no worse than it (attempt, group size, balance
targets; the plans differ since split documents go by work per ring step) and
scripts/plan_dispatch_timing.py times against it. :func:`reference_plan_dispatch` returns (runs,
levels, group_size, attempt, work). Slow on purpose (pure Python loops); tests only. Do not "fix"
it: its value is that it does not change.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Optional

import numpy as np

from megatron_burst.masks.bounds import checked_bounds
from megatron_burst.masks.dispatch import (ATTEMPTS, MAX_IMBALANCE, MAX_STEP_IMBALANCE, CuSeqlens, _metrics,
                                           check_divisible, level_chain, placement_order)


def _lpt_spread(items: list, bins: int) -> tuple:
    """(max load, mean load) of largest-first greedy of ``items`` (sorted descending) into ``bins``."""
    if not items:
        return 0.0, 0.0
    mean = sum(items) / bins
    if len(items) <= bins:
        return items[0], mean
    h = [0.0] * bins
    for x in items:
        heapq.heapreplace(h, h[0] + x)
    return max(h), mean


class _Filler:
    """Largest-first placement of whole documents into ranks with token room, choosing the rank with the
    least projected work: load + free tokens x (mean work per token of the documents still to place).

    Documents should come in decreasing length. Ranks whose free tokens are below the current length
    wait in a second heap (by free tokens) until the lengths come down to them, so each placement
    costs O(log W) amortized. The density is refreshed (at most every 8 placements) when it drifts
    by more than 10 %.
    """

    def __init__(self, ranks: list, tok: list, load: list, C: int, pool_w: float, pool_t: int):
        self.ranks, self.tok, self.load, self.C = ranks, tok, load, C
        self.pool_w, self.pool_t = pool_w, pool_t
        self.heap: list = []
        self.waiting: list = []
        self.rho = -1.0
        self.since = 0

    def _build(self, length: int) -> None:
        self.since = 0
        self.rho = self.pool_w / self.pool_t if self.pool_t else 0.0
        tok, load, C, rho = self.tok, self.load, self.C, self.rho
        self.heap = [(load[r] + (C - tok[r]) * rho, r) for r in self.ranks if C - tok[r] >= length]
        self.waiting = [(tok[r] - C, r) for r in self.ranks if 0 < C - tok[r] < length]
        heapq.heapify(self.heap)
        heapq.heapify(self.waiting)

    def place(self, length: int, work: float, pool_work: Optional[float] = None,
              pool_tokens: Optional[int] = None) -> Optional[int]:
        """The rank for a document (its work and tokens added), or None if no rank has room. ``pool_work``,
        ``pool_tokens``: what to take off the pool if not ``work``, ``length`` (split documents: the
        unit is one coset member)."""
        self.since += 1
        self.pool_w -= work if pool_work is None else pool_work
        self.pool_t -= length if pool_tokens is None else pool_tokens
        drift = abs(self.pool_w - self.rho * self.pool_t)
        if self.rho < 0 or (self.since >= 8 and drift > 0.1 * self.rho * self.pool_t):
            self._build(length)
        heap, waiting, tok, load, C, rho = self.heap, self.waiting, self.tok, self.load, self.C, self.rho
        push, pop = heapq.heappush, heapq.heappop
        while waiting and -waiting[0][0] >= length:
            r0 = pop(waiting)[1]
            push(heap, (load[r0] + (C - tok[r0]) * rho, r0))
        while heap:
            r = heap[0][1]
            if C - tok[r] >= length:
                tok[r] += length
                load[r] += work
                if tok[r] < C:
                    heapq.heapreplace(heap, (load[r] + (C - tok[r]) * rho, r))
                else:
                    pop(heap)
                return r
            pop(heap)
            push(waiting, (tok[r] - C, r))
        return None


def _subset_moves(pos: list, neg: list, target: int) -> Optional[tuple]:
    """Subsets P of ``pos`` and N of ``neg`` ((size, tag) lists) with sum(P) - sum(N) == target (bitset DP
    over Python ints), as (tags of P, tags of N), or None."""
    items = pos + neg
    off = sum(x for x, _ in neg)
    bits, hist = 1 << off, []
    for i, (x, _) in enumerate(items):
        hist.append(bits)
        bits |= (bits << x) if i < len(pos) else (bits >> x)
    p = off + target
    if p < 0 or not (bits >> p) & 1:
        return None
    P, N = [], []
    for i in range(len(items) - 1, -1, -1):
        if (hist[i] >> p) & 1:
            continue
        x, tag = items[i]
        if i < len(pos):
            P.append(tag)
            p -= x
        else:
            N.append(tag)
            p += x
    return P, N


# --------------------------------------------------------------------------------------------- #
# one planning attempt


def _attempt(b: list, L: list, w: list, W: int, alpha: float, allow_w: bool, all_w: bool,
             tol: float = 0.03, pull_tol: float = 0.01, dp_items: int = 32, desc: Optional[list] = None) -> tuple:
    """One configuration: returns (whole, pieces, levels, group_size): whole[d] = the rank of a document kept
    whole (-1: in pieces), pieces[d] = [[offset, size, rank], ...] by offset for the others.
    ``desc``: the documents by decreasing work (ties by index)."""
    n = len(L)
    S = b[-1]
    C = S // W
    T = sum(w)
    F = T / W if T else 1.0
    ks = level_chain(W)
    top = ks[-2] if len(ks) > 1 else 1
    if all_w or (W > 1 and (allow_w or any(w[d] / top > F or L[d] > top * C for d in range(n)))):
        top = W
    allowed = [k for k in ks if k <= top]
    nxt = {k: allowed[i + 1] for i, k in enumerate(allowed[:-1])}
    if desc is None:
        desc = sorted(range(n), key=lambda d: (-w[d], d))
    if all_w:
        lev = [W] * n
    else:  # the smallest allowed level with work / k <= alpha F and L / k <= C
        need = np.maximum(np.asarray(w, dtype=np.float64) / max(alpha * F, 1e-300), np.asarray(L) / C)
        pick = np.searchsorted(np.asarray(allowed, dtype=np.float64), need * (1 - 1e-12), side="left")
        lev = np.asarray(allowed + [top])[np.minimum(pick, len(allowed))].tolist()
        _promote(lev, L, w, W, C, F, allowed, nxt, tol, desc)
        _pull(lev, L, w, W, C, F, allowed, pull_tol, desc)
    G = W // top  # groups: rank r is in group r % G; no document spans two groups
    by_work = sorted(desc, key=lev.__getitem__, reverse=True)  # stable: level desc, then work desc
    group, left = _groups(lev, L, w, C, G, top, by_work, dp_items, desc)

    tok, load = [0] * W, [0.0] * W
    home, share = {}, {}
    rem_w, rem_t = [0.0] * G, [0] * G  # per group: work and tokens not placed yet
    buckets: dict = {}
    for d in by_work:
        if group[d] >= 0:
            rem_w[group[d]] += w[d]
            rem_t[group[d]] += L[d]
            buckets.setdefault((lev[d], group[d]), []).append(d)

    def put(d: int, k: int, a: int, sh: list) -> None:
        lev[d], share[d], home[d] = k, sh, (k, a)
        stride = W // k
        for j in range(k):
            r = a + j * stride
            tok[r] += sh[j]
            load[r] += w[d] / k

    for k in reversed(allowed):  # split documents, top level first: coset with least projected work
        if k == 1:
            break
        stride = W // k
        for A in range(G):
            docs = buckets.get((k, A))
            if not docs:
                continue
            units = list(range(A, stride, G))
            ctok = [max(tok[a + j * stride] for j in range(k)) for a in range(stride)]
            cload = load[:stride]
            filler = _Filler(units, ctok, cload, C, rem_w[A], rem_t[A])
            for d in docs:
                sh = [L[d] * (j + 1) // k - L[d] * j // k for j in range(k)]
                a = filler.place(sh[-1], w[d] / k, w[d], L[d])
                rem_w[A] -= w[d]
                rem_t[A] -= L[d]
                if a is not None:
                    put(d, k, a, sh)
                    continue
                k2 = k  # no coset has room: a larger coset of the group (shares shrink), else cut later
                while k2 != top:
                    k2 = nxt[k2]
                    st2 = W // k2
                    sh2 = [L[d] * (j + 1) // k2 - L[d] * j // k2 for j in range(k2)]
                    fits = [a2 for a2 in range(A, st2, G) if all(tok[a2 + j * st2] + sh2[j] <= C for j in range(k2))]
                    if fits:
                        put(d, k2, min(fits, key=lambda a2: (load[a2], a2)), sh2)
                        for a2 in range(stride):  # the filler's view of the cosets is stale now
                            ctok[a2] = max(tok[a2 + j * stride] for j in range(k))
                        filler.rho = -1.0
                        break
                else:
                    lev[d] = 1  # placed whole below, or cut into holes

    rest = []
    whole = [-1] * n  # the rank of each document kept whole
    for A in range(G):  # whole documents, by projected work
        pool = [d for d in desc if lev[d] == 1 and group[d] == A]
        filler = _Filler(list(range(A, W, G)), tok, load, C, sum(w[d] for d in pool), sum(L[d] for d in pool))
        place = filler.place
        for d in pool:
            r = place(L[d], w[d])
            if r is None:
                rest.append(d)
            else:
                whole[d] = r
    rest += [d for d in left if whole[d] < 0 and d not in home and d not in rest]

    pieces = {}  # documents in several pieces: [[offset, size, rank], ...] by offset
    for d, (k, a) in home.items():
        sh, stride, ps, off = share[d], W // k, [], 0
        sizes = [0] * (2 * k)
        for j in range(k):
            sizes[j] = sh[j] - sh[j] // 2
            sizes[2 * k - 1 - j] = sh[j] // 2
        for c in range(2 * k):
            if sizes[c]:
                ps.append([off, sizes[c], a + (c if c < k else 2 * k - 1 - c) * stride])
            off += sizes[c]
        pieces[d] = ps
    for d in sorted(rest, key=lambda d: (-L[d], d)):  # cut into holes: own group, least work first
        A = group[d] if group[d] >= 0 else None
        holes = [r for r in range(W) if tok[r] < C]
        fit = [r for r in holes if C - tok[r] >= L[d] and (A is None or r % G == A)]
        if fit:
            r = min(fit, key=lambda r: (load[r], r))
            whole[d] = r
            lev[d] = 1
            tok[r] += L[d]
            load[r] += w[d]
            continue
        holes.sort(key=lambda r: (A is not None and r % G != A, load[r], r))
        ps, off = [], 0
        for r in holes:
            if off >= L[d]:
                break
            m = min(L[d] - off, C - tok[r])
            ps.append([off, m, r])
            tok[r] += m
            load[r] += m * (m + 1) / 2 + m * off
            off += m
        if off != L[d]:
            raise AssertionError("dispatch planner lost tokens")  # cannot happen: holes sum to the rest
        pieces[d] = ps
        lev[d] = 0
    if any(t != C for t in tok):
        raise AssertionError(f"dispatch planner filled ranks unevenly: {tok}")
    return whole, pieces, lev, max(max(lev), 1)


def _promote(lev, L, w, W, C, F, allowed, nxt, tol, desc) -> None:
    """Bottom-up: a level whose documents a largest-first greedy cannot balance over its cosets sends its
    largest documents one level up: the p largest for the smallest p found that balances (at level 1
    first all documents above a quarter of a rank's share, then doubling, then two halvings back).
    Level 1 is simulated with the token capacity (:class:`_Filler`, the documents below tol x F / 2
    modelled as filling the holes evenly); higher levels by work alone."""
    n = len(L)
    for k in allowed[:-1]:
        k2, bins = nxt[k], W // k
        items = [d for d in desc if lev[d] == k]
        if not items:
            continue
        above = [d for d in range(n) if lev[d] > k]
        above_total = sum(w[d] for d in above)  # their work summed over ranks
        above_step = sum(w[d] / lev[d] for d in above) / W  # their mean per-rank work on one active step
        above_t = sum(L[d] for d in above)
        heavy = sum(1 for d in items if w[d] > F / 4) if k == 1 else 0
        rest_w = [-w[d] for d in items]  # ascending, for bisect
        tried: dict = {}

        def fails(p: int) -> bool:
            """Whether the level stays unbalanced with its ``p`` largest documents promoted."""
            if p not in tried:
                up, rest = items[:p], items[p:]
                if k == 1:  # whole documents: tokens matter (exact capacity), simulate the real greedy
                    tok = [(above_t + sum(L[d] for d in up)) / W] * W
                    load = [(above_total + sum(w[d] for d in up)) / W] * W
                    # documents below tol F / 2 are many and light: modelled as filling the holes evenly
                    i = bisect.bisect_left(rest_w, -tol * F / 2, p)
                    big, small = items[p:i], items[i:]
                    small_w, small_t = sum(w[d] for d in small), sum(L[d] for d in small)
                    filler = _Filler(list(range(W)), tok, load, C, sum(w[d] for d in big) + small_w,
                                     sum(L[d] for d in big) + small_t)
                    lost = [w[d] for d in big if filler.place(L[d], w[d]) is None]
                    rho = small_w / small_t if small_t else 0.0
                    load = [x + (C - t) * rho for x, t in zip(load, tok)]
                    if lost:  # cut into the holes later: modelled as landing on the least loaded ranks
                        heapq.heapify(load)
                        for x in lost:
                            heapq.heapreplace(load, load[0] + x)
                    tried[p] = max(load) - sum(load) / W > tol * F
                else:
                    mx, mean = _lpt_spread([w[d] / (k * k) for d in rest], bins)
                    tried[p] = mx - mean > tol * (mean + above_step + sum(w[d] / k2 for d in up) / W)
            return tried[p]

        lo, p = -1, 0  # doubling search for a p that balances, then 2 halvings back towards lo
        while p < len(items) and fails(p):
            lo = p
            p = heavy if p < heavy else min(len(items), max(1, 2 * p))
        for _ in range(2):
            mid = (lo + p) // 2
            if mid <= lo or mid >= p:
                break
            if fails(mid):
                lo = mid
            else:
                p = mid
        for d in items[:p]:
            lev[d] = k2


def _pull(lev, L, w, W, C, F, allowed, pull_tol, desc) -> None:
    """Top-down: balance each level's cosets (largest-first, on per-member work including the levels above)
    and fill light cosets by pulling the largest fitting smaller documents up to that level."""
    prev_w = prev_t = None
    prev_c = 1
    asc = desc[::-1]
    for k in reversed(allowed):
        if k == 1:
            break
        items = [d for d in desc if lev[d] == k]
        if not items and prev_w is None:
            continue
        c = W // k
        wk = [prev_w[a % prev_c] for a in range(c)] if prev_w else [0.0] * c
        tk = [prev_t[a % prev_c] for a in range(c)] if prev_t else [0.0] * c
        heap = [(wk[a], a) for a in range(c)]
        heapq.heapify(heap)
        for d in items:
            _, a = heapq.heappop(heap)
            wk[a] += w[d] / k
            tk[a] += L[d] / k
            heapq.heappush(heap, (wk[a], a))
        pool = [d for d in asc if lev[d] < k]  # increasing work
        pw = [w[d] / k for d in pool]
        target = max(wk)
        for a in sorted(range(c), key=lambda a: (wk[a], a)):
            while target - wk[a] > pull_tol * F and pool:
                i = bisect.bisect_right(pw, target - wk[a] + pull_tol * F) - 1
                while i >= 0 and tk[a] + L[pool[i]] / k > C:
                    i -= 1
                if i < 0 or pw[i] < pull_tol * F / 2:  # nothing that fits, or too light to matter (keep it whole)
                    break
                d = pool.pop(i)
                pw.pop(i)
                lev[d] = k
                wk[a] += w[d] / k
                tk[a] += L[d] / k
        prev_w, prev_t, prev_c = wk, tk, c


def _groups(lev, L, w, C, G, top, by_work, dp_items, desc) -> tuple:
    """Deal documents to the G top-level cosets (largest work first, least-work group with token room) and
    make every group's tokens exactly top x C by moving a subset of small documents. Returns (group per
    document, documents left without a group: cut across groups later)."""
    n = len(L)
    if G == 1:
        return [0] * n, []
    budget = top * C
    asc = desc[::-1]
    group, gtok, gw, left = [-1] * n, [0] * G, [0.0] * G, []
    for d in by_work:
        A, best, x = -1, None, L[d]
        for g in range(G):
            if gtok[g] + x <= budget and (best is None or (gw[g], gtok[g]) < best):
                A, best = g, (gw[g], gtok[g])
        if A < 0:
            left.append(d)
            continue
        group[d] = A
        gw[A] += w[d]
        gtok[A] += L[d]
    for _ in range(2 * G):
        hole = [budget - t for t in gtok]
        if not left and not any(hole):
            break
        A = max(range(G), key=lambda x: (hole[x], -x))
        B = min((x for x in range(G) if x != A), key=lambda x: (hole[x], x))

        def small(X: int) -> list:  # the group's dp_items shortest movable documents
            return list(itertools.islice(((L[d], d) for d in asc if group[d] == X and lev[d] < top), dp_items))

        pos = [(L[d], ("L", d)) for d in left] + [(x, ("M", d)) for x, d in small(B)]
        neg = [(x, ("M", d)) for x, d in small(A)]
        sol = _subset_moves(pos, neg, hole[A])
        if sol is None:
            break
        for tag, d in sol[0]:
            if tag == "L":
                left.remove(d)
            else:
                gtok[B] -= L[d]
            group[d] = A
            gtok[A] += L[d]
        for _, d in sol[1]:
            group[d] = B
            gtok[A] -= L[d]
            gtok[B] += L[d]
        if G == 2 and left:  # the rest of the leftovers are B's
            for d in left:
                group[d] = B
                gtok[B] += L[d]
            left = []
    return group, left


def _plan_work(whole: list, pieces: dict, w: list, W: int, causal: bool) -> np.ndarray:
    """[W, W] visible pairs of rank r at ring step t, exactly, from the documents' placement (a piece
    sees every earlier piece of its document entirely)."""
    r = np.asarray(whole, dtype=np.int64)
    keep = r >= 0
    work = np.zeros(W * W, dtype=np.float64)
    work += np.bincount(r[keep] * W, weights=np.asarray(w, dtype=np.float64)[keep], minlength=W * W)
    by_m: dict = {}
    for ps in pieces.values():
        by_m.setdefault(len(ps), []).append(ps)
    for m, group in by_m.items():
        arr = np.asarray(group, dtype=np.int64)  # [docs, m, 3]
        size = arr[:, :, 1].astype(np.float64)
        rank = arr[:, :, 2]
        inner = size * (size + 1) / 2 if causal else size * size
        work += np.bincount((rank * W).ravel(), weights=inner.ravel(), minlength=W * W)
        if m == 1:
            continue
        qi, kj = np.tril_indices(m, -1) if causal else np.nonzero(~np.eye(m, dtype=bool))
        pairs = size[:, qi] * size[:, kj]
        step = (rank[:, qi] - rank[:, kj]) % W
        work += np.bincount((rank[:, qi] * W + step).ravel(), weights=pairs.ravel(), minlength=W * W)
    return work.reshape(W, W)


def reference_plan_dispatch(cu_seqlens: CuSeqlens, world_size: int, *, ranks_per_node: Optional[int] = None,
                            causal: bool = True, max_imbalance: float = MAX_IMBALANCE,
                            max_step_imbalance: float = MAX_STEP_IMBALANCE) -> tuple:
    """The pre-speed-up ``plan_dispatch``: (runs, levels, group_size, attempt, work) of its plan."""
    b = list(checked_bounds(cu_seqlens, None, "cu_seqlens"))
    S, W = b[-1], world_size
    check_divisible(S, W)
    order = placement_order(W, ranks_per_node)
    L = [y - x for x, y in zip(b, b[1:])]
    w = [l * (l + 1) // 2 for l in L] if causal else [l * l for l in L]
    desc = sorted(range(len(L)), key=lambda d: (-w[d], d))
    best = None
    for i, (alpha, allow_w, all_w) in enumerate(ATTEMPTS if W > 1 else ATTEMPTS[:1]):
        whole, pieces, lev, gsize = _attempt(b, L, w, W, alpha, allow_w, all_w, desc=desc)
        work = _plan_work(whole, pieces, w, W, causal)
        m = _metrics(work)
        score = max(m["worker_total"] - 1, (m["worker"] - 1) / 3)
        if best is None or score < best[0] - 1e-12:
            best = (score, i, whole, pieces, lev, gsize, work)
        if m["worker_total"] <= max_imbalance and m["worker"] <= max_step_imbalance:
            best = (score, i, whole, pieces, lev, gsize, work)
            break
    _, i, whole, pieces, lev, gsize, work = best
    # whole / pieces name plan positions; runs name the physical rank each position is placed on
    runs = [(b[d], L[d], order[p]) for d, p in enumerate(whole) if p >= 0]
    runs += [(b[d] + off, size, order[p]) for d, ps in pieces.items() for off, size, p in ps]
    runs.sort()
    return tuple(runs), tuple(lev), gsize, i, work
