# cython: language_level=3
"""Redistribution planner kernel: unify two device matrices, then search the cheapest
sequence of steps (bytes moved per device) between two tensor layouts.

The rules are those of :mod:`dualmode.parallel.redistribution` (whose docstring
explains them) and of its pure-Python ``reference_plan``; the tests compare the two.

* ``_unify``: the common refinement of two device matrices (cut both at every rank
  stride of either), or failure when the strides do not nest.
* ``_search``: A* search over states ``(per-dim lists of unified axes, pending
  partial axes)`` packed into two 64-bit words (4 bits of dim code and 4 bits of
  position per axis), with an open-addressing hash table of nodes and a binary heap
  ordered by ``(bytes so far + lower bound, steps, push order)``. Moves: AllGather /
  AllToAll (into a dim whose map agrees with the destination so far) of a dim's
  innermost unsettled splits, ReduceScatter into a dim whose map agrees with the
  destination so far, AllReduce of the pending axes; LocalSlices are taken eagerly (the
  closure). The lower bound ``_bound`` is consistent, so the first goal reached is a
  cheapest one. Over ``budget`` expansions the direct plan is used instead.
* ``_replay``: the moves of the path, re-applied, as steps with their buffer sizes.

``plan`` (the ``def`` entry) validates and converts its tuples with the GIL held, runs
the kernels without it, and returns ``(status, unified sizes, steps)`` with
``steps = [(name, dims, axes, parts, bytes), ...]`` (status 1: no common refinement;
2: the destination keeps partial axes the source does not have; an OverflowError when
the problem exceeds the kernel's fixed sizes).
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

cdef enum:
    MAXAX = 16          # unified device axes (4-bit positions, 16 x 4 bits per key word)
    MAXDIM = 12         # tensor dims (dim codes 0..11; 14 = pending partial, 15 = free)
    MAXPATH = 64        # moves in one plan
    MAXSTEP = 192       # steps in one plan (moves and slices)
    CODE_PEND = 14
    CODE_FREE = 15

cdef enum:
    K_SLICE = 0
    K_GATHER = 1
    K_A2A = 2
    K_RS = 3
    K_AR = 4

DEFAULT_BUDGET = 4096
NAMES = ("LocalSlice", "AllGather", "AllToAll", "ReduceScatter", "AllReduce")
LIMITS = {"axes": MAXAX, "dims": MAXDIM}


ctypedef struct Problem:
    int K                       # unified axes
    int D                       # tensor dims
    int64_t size[MAXAX]
    int64_t shape[MAXDIM]
    int64_t total               # elements of the global tensor
    int tlen[MAXDIM]            # destination lists
    int8_t tgt[MAXDIM][MAXAX]
    uint32_t tmask              # axes in some destination list
    int slen[MAXDIM]            # source lists
    int8_t src[MAXDIM][MAXAX]
    uint32_t pending            # partial axes the plan must resolve
    int64_t floor               # smallest buffer a device can hold (every axis but the
                                # kept partial ones splitting): the lower bound's unit

ctypedef struct State:
    int len[MAXDIM]
    int8_t ax[MAXDIM][MAXAX]
    uint32_t pend

ctypedef struct StepRec:
    int kind
    int d0
    int d1
    int naxes
    int8_t axes[MAXAX]
    int64_t parts
    int64_t elems               # one device's buffer before the step

ctypedef struct Node:
    uint64_t k0
    uint64_t k1
    double g
    int32_t ns
    int32_t parent
    int32_t move
    int32_t closed

ctypedef struct HeapItem:
    double f                    # g + lower bound
    int32_t ns
    int32_t cnt
    int32_t node

ctypedef struct Search:
    Node* nodes
    int32_t nnodes
    int32_t capnodes
    int32_t* slots
    int32_t capslots
    HeapItem* heap
    int32_t nheap
    int32_t capheap


# ------------------------------------------------------------------ unification


cdef int _unify(const int64_t* a, int na, const int64_t* b, int nb, int64_t* sizes,
                int* ra0, int* ra1, int* rb0, int* rb1) noexcept nogil:
    """Unified axis sizes of device matrices a and b (same product) and, per axis of each,
    its run [r0, r1) of unified axes. Returns K, -1 when the strides do not nest, -2 when
    K exceeds MAXAX."""
    cdef int64_t ha[MAXAX + 1]
    cdef int64_t hb[MAXAX + 1]
    cdef int64_t cuts[2 * MAXAX + 2]
    cdef int i = 0, j = 0, n = 0, k
    cdef int64_t v
    # descending rank strides: h[i] = prod(dm[i:]), h[n] = 1
    ha[na] = 1
    for k in range(na - 1, -1, -1):
        ha[k] = ha[k + 1] * a[k]
    hb[nb] = 1
    for k in range(nb - 1, -1, -1):
        hb[k] = hb[k + 1] * b[k]
    while i <= na or j <= nb:          # merge, dropping duplicates
        if j > nb or (i <= na and ha[i] >= hb[j]):
            v = ha[i]
            i += 1
        else:
            v = hb[j]
            j += 1
        if n == 0 or cuts[n - 1] != v:
            cuts[n] = v
            n += 1
    if n - 1 > MAXAX:
        return -2
    for k in range(n - 1):
        if cuts[k] % cuts[k + 1]:
            return -1
        sizes[k] = cuts[k] // cuts[k + 1]
    _runs(ha, na, cuts, n, ra0, ra1)
    _runs(hb, nb, cuts, n, rb0, rb1)
    return n - 1


cdef void _runs(const int64_t* h, int m, const int64_t* cuts, int n, int* r0,
                int* r1) noexcept nogil:
    """Axis i of a matrix with strides h spans the cuts from h[i] down to h[i + 1]."""
    cdef int i, c = 0
    for i in range(m):
        while cuts[c] != h[i]:
            c += 1
        r0[i] = c
        while cuts[c] != h[i + 1]:
            c += 1
        r1[i] = c


# ------------------------------------------------------------------ states


cdef inline int64_t _prod(const Problem* p, const int8_t* axes, int n) noexcept nogil:
    cdef int64_t r = 1
    cdef int i
    for i in range(n):
        r *= p.size[axes[i]]
    return r


cdef inline int64_t _elems(const Problem* p, const State* s) noexcept nogil:
    """One device's buffer (elements) in state s."""
    cdef int64_t r = 1
    cdef int d
    for d in range(p.D):
        r *= _prod(p, s.ax[d], s.len[d])
    return p.total // r


cdef inline int _prefix(const Problem* p, const State* s, int d) noexcept nogil:
    """Length of the common prefix of dim d's list and its destination list."""
    cdef int i = 0
    while i < s.len[d] and i < p.tlen[d] and s.ax[d][i] == p.tgt[d][i]:
        i += 1
    return i


cdef inline uint32_t _used(const Problem* p, const State* s) noexcept nogil:
    cdef uint32_t m = s.pend
    cdef int d, i
    for d in range(p.D):
        for i in range(s.len[d]):
            m |= (<uint32_t>1) << s.ax[d][i]
    return m


cdef int _closure(const Problem* p, State* s, StepRec* rec, int* nrec) noexcept nogil:
    """Extend every dim whose list agrees with its destination so far by the free axes
    that come next there (LocalSlice, no communication). Returns the number of slices;
    records them in rec[*nrec...] when rec is not NULL."""
    cdef uint32_t used = _used(p, s)
    cdef int d, n, j, i, count = 0
    cdef StepRec* r
    for d in range(p.D):
        n = s.len[d]
        if _prefix(p, s, d) != n:
            continue
        j = n
        while j < p.tlen[d] and not (used >> p.tgt[d][j]) & 1:
            s.ax[d][j] = p.tgt[d][j]
            j += 1
        if j > n:
            s.len[d] = j
            if rec != NULL:
                r = &rec[nrec[0]]
                r.kind = K_SLICE
                r.d0 = d
                r.d1 = -1
                r.naxes = j - n
                for i in range(j - n):
                    r.axes[i] = p.tgt[d][n + i]
                r.parts = _prod(p, r.axes, r.naxes)
                r.elems = 0
                nrec[0] += 1
            count += 1
    return count


cdef void _apply(const Problem* p, State* s, int move, int64_t elems,
                 StepRec* r) noexcept nogil:
    """Apply a packed move (kind | d << 4 | e << 8 | k << 12) to s, whose buffer holds
    `elems` elements; describe it in r."""
    cdef int kind = move & 15, d = (move >> 4) & 15, e = (move >> 8) & 15
    cdef int k = (move >> 12) & 31, i, x, n
    r.elems = elems
    r.d0 = d
    r.d1 = -1
    r.naxes = 0
    if kind == K_GATHER or kind == K_A2A:
        n = s.len[d] - k
        for i in range(k):
            r.axes[i] = s.ax[d][n + i]
        r.naxes = k
        s.len[d] = n
        if kind == K_A2A:
            r.d1 = e
            for i in range(k):
                s.ax[e][s.len[e] + i] = r.axes[i]
            s.len[e] += k
    elif kind == K_RS:
        n = s.len[d]
        for i in range(k):
            x = p.tgt[d][n + i]
            r.axes[i] = x
            s.ax[d][n + i] = x
            s.pend &= ~((<uint32_t>1) << x)
        r.naxes = k
        s.len[d] = n + k
    else:                               # AllReduce of every pending axis (e == 0) or of
        r.d0 = -1                       # those no destination dim wants (e == 1)
        for x in range(p.K):
            if (s.pend >> x) & 1 and (e == 0 or not (p.tmask >> x) & 1):
                r.axes[r.naxes] = x
                r.naxes += 1
                s.pend &= ~((<uint32_t>1) << x)
    r.kind = kind
    r.parts = _prod(p, r.axes, r.naxes)


cdef inline double _cost(int kind, int64_t n, int64_t S) noexcept nogil:
    """Elements moved per device (trace.py's formulas)."""
    if kind == K_GATHER:
        return <double>((n - 1) * S)
    if kind == K_AR:
        return <double>(2 * (n - 1) * S) / <double>n
    return <double>((n - 1) * S) / <double>n


cdef double _bound(const Problem* p, const State* s) noexcept nogil:
    """Elements still to move, at least (consistent, so A* stays exact): every split the
    destination drops needs an AllGather ((n - 1) floor); every other dim that must drop
    splits needs a collective over its innermost axis ((n - 1) / n floor); pending sums
    need one over their largest axis."""
    cdef double h = 0.0
    cdef int d, i, x, pre
    cdef int64_t n = 0
    cdef bint wanted
    for d in range(p.D):
        for i in range(s.len[d]):
            x = s.ax[d][i]
            if not (p.tmask >> x) & 1:
                h += <double>((p.size[x] - 1) * p.floor)
    for d in range(p.D):
        pre = _prefix(p, s, d)
        if pre < s.len[d]:
            wanted = True
            for i in range(pre, s.len[d]):
                if not (p.tmask >> s.ax[d][i]) & 1:
                    wanted = False
            if wanted:
                n = p.size[s.ax[d][s.len[d] - 1]]
                h += <double>((n - 1) * p.floor) / <double>n
    if s.pend:
        n = 0
        for x in range(p.K):
            if (s.pend >> x) & 1 and p.size[x] > n:
                n = p.size[x]
        h += <double>((n - 1) * p.floor) / <double>n
    return h


cdef inline void _encode(const Problem* p, const State* s, uint64_t* k0,
                         uint64_t* k1) noexcept nogil:
    cdef uint64_t w0 = 0, w1 = 0
    cdef int x, d, i
    for x in range(p.K):
        w0 |= (<uint64_t>(CODE_PEND if (s.pend >> x) & 1 else CODE_FREE)) << (4 * x)
    for d in range(p.D):
        for i in range(s.len[d]):
            x = s.ax[d][i]
            w0 = (w0 & ~((<uint64_t>15) << (4 * x))) | ((<uint64_t>d) << (4 * x))
            w1 |= (<uint64_t>i) << (4 * x)
    k0[0] = w0
    k1[0] = w1


cdef inline void _decode(const Problem* p, uint64_t w0, uint64_t w1, State* s) noexcept nogil:
    cdef int x, c, i
    s.pend = 0
    for x in range(p.D):
        s.len[x] = 0
    for x in range(p.K):
        c = (w0 >> (4 * x)) & 15
        if c < MAXDIM:
            i = (w1 >> (4 * x)) & 15
            s.ax[c][i] = x
            if i + 1 > s.len[c]:
                s.len[c] = i + 1
        elif c == CODE_PEND:
            s.pend |= (<uint32_t>1) << x


cdef inline bint _is_goal(const Problem* p, const State* s) noexcept nogil:
    cdef int d
    if s.pend:
        return False
    for d in range(p.D):
        if s.len[d] != p.tlen[d] or _prefix(p, s, d) != s.len[d]:
            return False
    return True


cdef int _moves(const Problem* p, const State* s, int* out) noexcept nogil:
    """The moves from s, in the reference planner's order. Returns their count."""
    cdef int pre[MAXDIM]
    cdef bint settled[MAXDIM]
    cdef int d, e, k, n, m = 0, x, nfree = 0, npend = 0
    cdef int64_t parts, local
    for d in range(p.D):
        pre[d] = _prefix(p, s, d)
        settled[d] = pre[d] == s.len[d]
    for d in range(p.D):
        for k in range(1, s.len[d] - pre[d] + 1):
            out[m] = K_GATHER | (d << 4) | (k << 12)
            m += 1
    for d in range(p.D):
        for k in range(1, s.len[d] - pre[d] + 1):
            parts = _prod(p, &s.ax[d][s.len[d] - k], k)
            for e in range(p.D):
                if e != d and settled[e]:
                    local = p.shape[e] // _prod(p, s.ax[e], s.len[e])
                    if local % parts == 0:
                        out[m] = K_A2A | (d << 4) | (e << 8) | (k << 12)
                        m += 1
    for d in range(p.D):
        if settled[d]:
            n = s.len[d]
            k = 0
            while n + k < p.tlen[d] and (s.pend >> p.tgt[d][n + k]) & 1:
                k += 1
            if k:
                out[m] = K_RS | (d << 4) | (k << 12)
                m += 1
    if s.pend:
        out[m] = K_AR
        m += 1
        for x in range(p.K):
            if (s.pend >> x) & 1:
                npend += 1
                if not (p.tmask >> x) & 1:
                    nfree += 1
        if nfree and nfree != npend:
            out[m] = K_AR | (1 << 8)
            m += 1
    return m


# ------------------------------------------------------------------ search containers


cdef inline uint64_t _hash(uint64_t a, uint64_t b) noexcept nogil:
    cdef uint64_t h = a * <uint64_t>0x9E3779B97F4A7C15 ^ (b + <uint64_t>0x632BE59BD9B4E019
                                                          + (a << 6) + (a >> 2))
    h ^= h >> 31
    h *= <uint64_t>0xBF58476D1CE4E5B9
    h ^= h >> 29
    return h


cdef int _grow_slots(Search* S) noexcept nogil:
    cdef int32_t cap = S.capslots * 2, i, j
    cdef int32_t* slots = <int32_t*>malloc(cap * sizeof(int32_t))
    if slots == NULL:
        return -1
    memset(slots, 0xFF, cap * sizeof(int32_t))
    for i in range(S.nnodes):
        j = <int32_t>(_hash(S.nodes[i].k0, S.nodes[i].k1) & <uint64_t>(cap - 1))
        while slots[j] != -1:
            j = (j + 1) & (cap - 1)
        slots[j] = i
    free(S.slots)
    S.slots = slots
    S.capslots = cap
    return 0


cdef int32_t _find_or_add(Search* S, uint64_t k0, uint64_t k1) noexcept nogil:
    """Index of the node with key (k0, k1), created (g = +inf) if new; -1 on no memory."""
    cdef int32_t j, i
    cdef Node* nodes
    if 2 * (S.nnodes + 1) > S.capslots:
        if _grow_slots(S):
            return -1
    j = <int32_t>(_hash(k0, k1) & <uint64_t>(S.capslots - 1))
    while S.slots[j] != -1:
        i = S.slots[j]
        if S.nodes[i].k0 == k0 and S.nodes[i].k1 == k1:
            return i
        j = (j + 1) & (S.capslots - 1)
    if S.nnodes == S.capnodes:
        nodes = <Node*>realloc(S.nodes, 2 * S.capnodes * sizeof(Node))
        if nodes == NULL:
            return -1
        S.nodes = nodes
        S.capnodes *= 2
    i = S.nnodes
    S.nnodes += 1
    S.slots[j] = i
    S.nodes[i].k0 = k0
    S.nodes[i].k1 = k1
    S.nodes[i].g = 1e308
    S.nodes[i].ns = 0x7FFFFFFF
    S.nodes[i].parent = -1
    S.nodes[i].move = -1
    S.nodes[i].closed = 0
    return i


cdef inline bint _less(const HeapItem* a, const HeapItem* b) noexcept nogil:
    if a.f != b.f:
        return a.f < b.f
    if a.ns != b.ns:
        return a.ns < b.ns
    return a.cnt < b.cnt


cdef int _push(Search* S, double f, int32_t ns, int32_t cnt, int32_t node) noexcept nogil:
    cdef HeapItem* h
    cdef HeapItem item
    cdef int32_t i, parent
    if S.nheap == S.capheap:
        h = <HeapItem*>realloc(S.heap, 2 * S.capheap * sizeof(HeapItem))
        if h == NULL:
            return -1
        S.heap = h
        S.capheap *= 2
    item.f = f
    item.ns = ns
    item.cnt = cnt
    item.node = node
    i = S.nheap
    S.nheap += 1
    while i > 0:
        parent = (i - 1) >> 1
        if not _less(&item, &S.heap[parent]):
            break
        S.heap[i] = S.heap[parent]
        i = parent
    S.heap[i] = item
    return 0


cdef HeapItem _pop(Search* S) noexcept nogil:
    cdef HeapItem top = S.heap[0], last
    cdef int32_t i = 0, c, n
    S.nheap -= 1
    n = S.nheap
    if n > 0:
        last = S.heap[n]
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and _less(&S.heap[c + 1], &S.heap[c]):
                c += 1
            if not _less(&S.heap[c], &last):
                break
            S.heap[i] = S.heap[c]
            i = c
        S.heap[i] = last
    return top


# ------------------------------------------------------------------ search


cdef int _greedy(const Problem* p, int* path) noexcept nogil:
    """The direct plan's moves: gather every unsettled split, then reduce-scatter into
    the destination where it can, then all-reduce the rest. Returns the path length."""
    cdef State s
    cdef StepRec r
    cdef int moves[4 * MAXDIM * MAXAX + 2]
    cdef int n = 0, d, pre, i, m, mv
    memset(&s, 0, sizeof(State))
    for d in range(p.D):
        s.len[d] = p.slen[d]
        memcpy(s.ax[d], p.src[d], MAXAX)
    s.pend = p.pending
    _closure(p, &s, NULL, NULL)
    while not _is_goal(p, &s) and n < MAXPATH:
        mv = -1
        for d in range(p.D):
            pre = _prefix(p, &s, d)
            if pre < s.len[d]:
                mv = K_GATHER | (d << 4) | ((s.len[d] - pre) << 12)
                break
        if mv < 0:
            m = _moves(p, &s, moves)
            mv = K_AR
            for i in range(m):
                if (moves[i] & 15) == K_RS:
                    mv = moves[i]
                    break
        path[n] = mv
        n += 1
        _apply(p, &s, mv, _elems(p, &s), &r)
        _closure(p, &s, NULL, NULL)
    return n if _is_goal(p, &s) else -2


cdef int _search(const Problem* p, int64_t budget, int* path) noexcept nogil:
    """A* search from the source to the destination state. Writes the moves
    to path; returns their count, -1 when out of memory, -2 when the path is too long."""
    cdef Search S
    cdef State s, t
    cdef StepRec r
    cdef HeapItem top
    cdef int moves[4 * MAXDIM * MAXAX + 2]
    cdef int nmoves, i, n, found = -1, status = 0
    cdef uint64_t k0, k1
    cdef int32_t cnt = 1, node, nxt
    cdef int64_t expansions = 0, elems
    cdef double g, ng
    cdef int32_t ns, nns

    S.capnodes = 256
    S.capslots = 1024
    S.capheap = 256
    S.nnodes = 0
    S.nheap = 0
    S.nodes = <Node*>malloc(S.capnodes * sizeof(Node))
    S.slots = <int32_t*>malloc(S.capslots * sizeof(int32_t))
    S.heap = <HeapItem*>malloc(S.capheap * sizeof(HeapItem))
    if S.nodes == NULL or S.slots == NULL or S.heap == NULL:
        free(S.nodes)
        free(S.slots)
        free(S.heap)
        return -1
    memset(S.slots, 0xFF, S.capslots * sizeof(int32_t))

    memset(&s, 0, sizeof(State))
    for i in range(p.D):
        s.len[i] = p.slen[i]
        memcpy(s.ax[i], p.src[i], MAXAX)
    s.pend = p.pending
    n = _closure(p, &s, NULL, NULL)
    _encode(p, &s, &k0, &k1)
    node = _find_or_add(&S, k0, k1)
    if node < 0:
        status = -1
    else:
        S.nodes[node].g = 0.0
        S.nodes[node].ns = n
        if _push(&S, _bound(p, &s), n, 0, node):
            status = -1

    while status == 0 and S.nheap > 0:
        top = _pop(&S)
        node = top.node
        if S.nodes[node].closed:
            continue
        S.nodes[node].closed = 1
        _decode(p, S.nodes[node].k0, S.nodes[node].k1, &s)
        if _is_goal(p, &s):
            found = node
            break
        expansions += 1
        if expansions > budget:
            break
        g = S.nodes[node].g
        ns = S.nodes[node].ns
        elems = _elems(p, &s)
        nmoves = _moves(p, &s, moves)
        for i in range(nmoves):
            memcpy(&t, &s, sizeof(State))
            _apply(p, &t, moves[i], elems, &r)
            n = _closure(p, &t, NULL, NULL)
            _encode(p, &t, &k0, &k1)
            nxt = _find_or_add(&S, k0, k1)
            if nxt < 0:
                status = -1
                break
            if S.nodes[nxt].closed:
                continue
            ng = g + _cost(r.kind, r.parts, r.elems)
            nns = ns + 1 + n
            if ng < S.nodes[nxt].g or (ng == S.nodes[nxt].g and nns < S.nodes[nxt].ns):
                S.nodes[nxt].g = ng
                S.nodes[nxt].ns = nns
                S.nodes[nxt].parent = node
                S.nodes[nxt].move = moves[i]
                if _push(&S, ng + _bound(p, &t), nns, cnt, nxt):
                    status = -1
                    break
                cnt += 1

    if status == 0:
        if found < 0:
            n = _greedy(p, path)
            if n < 0:
                status = n
        else:
            n = 0
            node = found
            while S.nodes[node].parent >= 0:
                if n == MAXPATH:
                    status = -2
                    break
                path[n] = S.nodes[node].move
                n += 1
                node = S.nodes[node].parent
            for i in range(n // 2):
                nmoves = path[i]
                path[i] = path[n - 1 - i]
                path[n - 1 - i] = nmoves
    free(S.nodes)
    free(S.slots)
    free(S.heap)
    return n if status == 0 else status


cdef int _replay(const Problem* p, const int* path, int npath, StepRec* out) noexcept nogil:
    """The steps of a path: each move followed by the slices its closure takes."""
    cdef State s
    cdef int nout = 0, i
    memset(&s, 0, sizeof(State))
    for i in range(p.D):
        s.len[i] = p.slen[i]
        memcpy(s.ax[i], p.src[i], MAXAX)
    s.pend = p.pending
    _closure(p, &s, out, &nout)
    for i in range(npath):
        if nout + 1 + p.D > MAXSTEP:
            return -2
        _apply(p, &s, path[i], _elems(p, &s), &out[nout])
        nout += 1
        _closure(p, &s, out, &nout)
    return nout


# ------------------------------------------------------------------ entry


cdef uint32_t _fill_lists(tuple tmap, int D, int naxes, const int* r0, const int* r1,
                          int* lens, int8_t (*lists)[MAXAX]) except? 0xFFFFFFFF:
    """Per dim, the unified axes of the original axes in tmap[d] (each a run); returns the
    mask of the axes used. Rejects axes out of range or used twice."""
    cdef int d, x, a, n
    cdef uint32_t used = 0
    for d in range(D):
        n = 0
        for a in tmap[d]:
            if not 0 <= a < naxes:
                raise ValueError(f"_redist.plan: tensor map {tmap} names device axis {a}; "
                                 f"valid axes are 0..{naxes - 1}")
            for x in range(r0[a], r1[a]):
                if (used >> x) & 1:
                    raise ValueError(f"_redist.plan: tensor map {tmap} uses device axis {a} "
                                     "twice")
                used |= (<uint32_t>1) << x
                lists[d][n] = x
                n += 1
        lens[d] = n
    return used


cdef uint32_t _mask(tuple axes, int naxes, const int* r0, const int* r1) except? 0xFFFFFFFF:
    cdef uint32_t m = 0
    cdef int a, x
    for a in axes:
        if not 0 <= a < naxes:
            raise ValueError(f"_redist.plan: partial axes {axes} name device axis {a}; "
                             f"valid axes are 0..{naxes - 1}")
        for x in range(r0[a], r1[a]):
            m |= (<uint32_t>1) << x
    return m


def plan(tuple src_dm, tuple src_map, tuple src_partial, tuple dst_dm, tuple dst_map,
         tuple dst_partial, tuple shape, Py_ssize_t itemsize=4,
         Py_ssize_t budget=DEFAULT_BUDGET):
    """Plan a redistribution between two valid layouts of the same shape and device count.

    Returns ``(status, sizes, steps)``: status 0 with the unified device matrix and the
    steps ``(name, dims, axes, parts, bytes)`` (name one of ``NAMES``; axes of the unified
    matrix, outer first; bytes moved per device); 1 when the device
    matrices have no common refinement; 2 when the destination's partial axes are not
    partial in the source. Raises OverflowError when the problem exceeds the kernel's
    fixed sizes (``LIMITS``).
    """
    cdef Problem P
    cdef int64_t a[MAXAX]
    cdef int64_t b[MAXAX]
    cdef int ra0[MAXAX]
    cdef int ra1[MAXAX]
    cdef int rb0[MAXAX]
    cdef int rb1[MAXAX]
    cdef int path[MAXPATH]
    cdef StepRec recs[MAXSTEP]
    cdef int na = len(src_dm), nb = len(dst_dm), D = len(shape), K, i, npath, nrec, d
    cdef uint32_t ps, pd, used_s, used_d
    cdef int64_t n, prod_a = 1, prod_b = 1
    cdef double s
    if na > MAXAX or nb > MAXAX or D > MAXDIM:
        raise OverflowError(f"_redist.plan: {D} dims / device matrices of {na} and {nb} axes "
                            f"exceed the kernel's limits {LIMITS}")
    if len(src_map) != D or len(dst_map) != D:
        raise ValueError(f"_redist.plan: the tensor maps {src_map} and {dst_map} must have "
                         f"one entry per dim of shape {shape}")
    if itemsize < 1 or budget < 0:
        raise ValueError(f"_redist.plan: itemsize={itemsize} must be >= 1 and "
                         f"budget={budget} >= 0")
    for i in range(na):
        a[i] = src_dm[i]
        prod_a *= a[i] if a[i] >= 1 else 0
    for i in range(nb):
        b[i] = dst_dm[i]
        prod_b *= b[i] if b[i] >= 1 else 0
    if prod_a != prod_b or prod_a < 1:
        raise ValueError(f"_redist.plan: device matrices {src_dm} and {dst_dm} must be "
                         "positive and hold the same number of devices")
    memset(&P, 0, sizeof(Problem))
    P.D = D
    P.total = 1
    for i in range(D):
        P.shape[i] = shape[i]
        if P.shape[i] < 0:
            raise ValueError(f"_redist.plan: shape {shape} has a negative size")
        P.total *= P.shape[i]
    with nogil:
        K = _unify(a, na, b, nb, P.size, ra0, ra1, rb0, rb1)
    if K == -2:
        raise OverflowError(f"_redist.plan: the device matrices {src_dm} and {dst_dm} unify "
                            f"to more than {MAXAX} axes")
    if K == -1:
        return 1, None, None
    P.K = K
    sizes = tuple([P.size[i] for i in range(K)])
    used_s = _fill_lists(src_map, D, na, ra0, ra1, P.slen, P.src)
    used_d = _fill_lists(dst_map, D, nb, rb0, rb1, P.tlen, P.tgt)
    ps = _mask(src_partial, na, ra0, ra1)
    pd = _mask(dst_partial, nb, rb0, rb1)
    if (ps & used_s) or (pd & used_d):
        raise ValueError(f"_redist.plan: a partial axis also splits a dim ({src_partial} "
                         f"with {src_map}, {dst_partial} with {dst_map})")
    for d in range(D):
        n = 1
        for i in range(P.slen[d]):
            n *= P.size[P.src[d][i]]
        if P.shape[d] % n:
            raise ValueError(f"_redist.plan: the source splits dim {d} of {shape} into {n}")
        n = 1
        for i in range(P.tlen[d]):
            n *= P.size[P.tgt[d][i]]
        if P.shape[d] % n:
            raise ValueError(f"_redist.plan: the destination splits dim {d} of {shape} "
                             f"into {n}")
    if pd & ~ps:
        return 2, sizes, None
    P.pending = ps & ~pd
    n = 1
    for i in range(K):
        if not (pd >> i) & 1:
            n *= P.size[i]
    P.floor = P.total // n
    for d in range(D):
        for i in range(P.tlen[d]):
            P.tmask |= (<uint32_t>1) << P.tgt[d][i]
    with nogil:
        npath = _search(&P, budget, path)
        nrec = _replay(&P, path, npath, recs) if npath >= 0 else npath
    if npath == -1:
        raise MemoryError("_redist.plan: out of memory in the search")
    if npath < 0 or nrec < 0:
        raise OverflowError(f"_redist.plan: the plan exceeds {MAXPATH} moves / {MAXSTEP} "
                            "steps")
    steps = []
    for i in range(nrec):
        n = recs[i].parts
        s = <double>(recs[i].elems * itemsize)
        if recs[i].kind == K_SLICE or n <= 1:
            s = 0.0
        elif recs[i].kind == K_AR:
            s = 2.0 * (n - 1) * s / n
        elif recs[i].kind == K_GATHER:
            s = (n - 1) * s
        else:
            s = (n - 1) * s / n
        if recs[i].d0 < 0:
            dims = ()
        elif recs[i].d1 < 0:
            dims = (recs[i].d0,)
        else:
            dims = (recs[i].d0, recs[i].d1)
        steps.append((NAMES[recs[i].kind], dims,
                      tuple([recs[i].axes[d] for d in range(recs[i].naxes)]), n, s))
    return 0, sizes, steps
