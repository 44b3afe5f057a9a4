# cython: language_level=3
"""A caching buffer pool for numpy array data (NEP 49 memory handler).

glibc serves blocks of 128 KiB or more by mmap and gives them back to the system on
free, so a step that allocates the same large arrays again every time page-faults all
of them in again. A :class:`Pool` keeps the freed large blocks (``min_block`` bytes or
more) in free lists, one per size class (the size rounded up to ``page`` bytes), and
hands the most recently freed block of a class back to the next request of that class
(as PyTorch's caching allocator does for device memory). Small blocks go straight to
malloc/free. At most ``max_cached_bytes`` are kept: caching a block beyond the cap
first gives the longest-cached blocks back to the system; a block larger than the cap
is never cached. :meth:`Pool.empty_cache` gives every cached block back.

Installed as numpy's data-memory handler (``PyDataMem_SetHandler``, per contextvars
context; :meth:`Pool.installed`), the pool serves every array data allocation made in
that context: malloc, calloc (zeroed, also when a cached block is reused) and realloc
(contents kept). numpy keeps the handler's capsule on each array it allocates, and
frees the array's data through it: a block freed after the handler was uninstalled
still goes back to the pool that made it. The capsule owns the pool's C state, which
lives as long as the capsule (the :class:`Pool` object and every array made by it).

Each block carries a header just before its data: its usable size and its offset from
the block the system gave, so free and realloc never rely on the size numpy passes.
The pool's lists are guarded by a pthread mutex (numpy may allocate and free from any
thread, with or without the GIL). The pure-Python model of the pool's policy, which the
tests compare with :meth:`Pool.stats`, is ``dualmode._core.arena_reference``.
"""
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint8_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset, strncpy

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, void* attr)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_mutex_destroy(pthread_mutex_t* m)

cdef extern from "<sys/mman.h>" nogil:
    int madvise(void* addr, size_t length, int advice)
    int MADV_HUGEPAGE

cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyDataMemAllocator:
        void* ctx
        void* (*malloc)(void* ctx, size_t size) noexcept nogil
        void* (*calloc)(void* ctx, size_t nelem, size_t elsize) noexcept nogil
        void* (*realloc)(void* ctx, void* ptr, size_t new_size) noexcept nogil
        void (*free)(void* ctx, void* ptr, size_t size) noexcept nogil

    ctypedef struct PyDataMem_Handler:
        char name[127]
        uint8_t version
        PyDataMemAllocator allocator

    object PyDataMem_SetHandler(object handler)
    object PyDataMem_GetHandler()
    int _import_array() except -1

_import_array()

cdef const char* CAPSULE_NAME = b"mem_handler"     # the name numpy requires

cdef enum:
    SMALL_HEADER = 16      # size + offset before a small block's data (malloc's alignment)
    ALIGN = 64             # a large block's data is 64-byte aligned (a cache line)
    MIN_TABLE = 64         # slots of a new class table (a power of two)
    HUGE_BLOCK = 1 << 22   # fresh blocks of 4 MiB or more ask for huge pages (as numpy)
    SYS_PAGE = 4096


cdef struct tail_t:
    # the last 16 bytes before every block's data
    size_t size            # usable bytes: the size class (large), the request (small)
    size_t offset          # data - the pointer malloc gave: SMALL_HEADER for a small block


cdef struct block_t:
    # the header before a large block's data (its `tail` ends right at the data)
    block_t* prev          # in its class's free list, while cached
    block_t* next
    block_t* older         # in the pool's age list, while cached
    block_t* newer
    size_t pad0
    size_t pad1
    tail_t tail


cdef struct class_t:
    size_t size            # the size class; 0: an empty slot of the table
    block_t* head          # its cached blocks, most recently freed first


cdef struct pool_t:
    pthread_mutex_t lock
    size_t min_block       # requests of fewer bytes are small (malloc/free)
    size_t page            # size classes are multiples of it
    size_t cap             # max_cached_bytes
    bint hugepages         # fresh blocks of 4 MiB or more ask for huge pages
    class_t* table         # open addressing on the class size, linear probing
    size_t table_slots     # a power of two
    size_t table_used      # slots holding a class (with or without cached blocks)
    block_t* oldest        # the age list of cached blocks (eviction takes the oldest)
    block_t* newest
    # statistics (large blocks only)
    size_t hits, misses, evictions, oversize
    size_t cached_bytes, cached_blocks, peak_cached_bytes
    size_t active_bytes, active_blocks, peak_active_bytes


# ---------------------------------------------------------------------------------------
# the class table and lists (the pool's lock held)
# ---------------------------------------------------------------------------------------
cdef inline size_t _slot(size_t size, size_t slots) noexcept nogil:
    return (size * <size_t>0x9E3779B97F4A7C15) >> 32 & (slots - 1)


cdef inline size_t _class(pool_t* p, size_t size) noexcept nogil:
    """The size class of a large request: `size` rounded up to a multiple of the page."""
    return (size + p.page - 1) & ~(p.page - 1)


cdef class_t* _find(pool_t* p, size_t size) noexcept nogil:
    """The table entry of class `size`, or NULL."""
    cdef size_t i = _slot(size, p.table_slots)
    while p.table[i].size != 0:
        if p.table[i].size == size:
            return &p.table[i]
        i = (i + 1) & (p.table_slots - 1)
    return NULL


cdef bint _rehash(pool_t* p, size_t slots) noexcept nogil:
    """Rebuild the table with `slots` slots, keeping only classes with cached blocks."""
    cdef class_t* old = p.table
    cdef size_t n = p.table_slots, i, j
    cdef class_t* t = <class_t*>calloc(slots, sizeof(class_t))
    if t == NULL:
        return False
    p.table, p.table_slots, p.table_used = t, slots, 0
    for i in range(n):
        if old[i].head != NULL:
            j = _slot(old[i].size, slots)
            while t[j].size != 0:
                j = (j + 1) & (slots - 1)
            t[j] = old[i]
            p.table_used += 1
    free(old)
    return True


cdef class_t* _find_or_add(pool_t* p, size_t size) noexcept nogil:
    """The table entry of class `size`, added if missing; NULL when out of memory."""
    cdef class_t* c = _find(p, size)
    cdef size_t i
    if c != NULL:
        return c
    if 2 * (p.table_used + 1) > p.table_slots:
        # grow, or only drop the empty classes when at most a quarter stay
        if not _rehash(p, p.table_slots * 2 if 4 * p.cached_blocks >= p.table_slots
                       else p.table_slots):
            return NULL
    i = _slot(size, p.table_slots)
    while p.table[i].size != 0:
        i = (i + 1) & (p.table_slots - 1)
    p.table[i].size = size
    p.table[i].head = NULL
    p.table_used += 1
    return &p.table[i]


cdef void _unlink(pool_t* p, block_t* b, class_t* c) noexcept nogil:
    """Take cached block `b` out of its class list `c` and the age list."""
    if b.prev != NULL:
        b.prev.next = b.next
    else:
        c.head = b.next
    if b.next != NULL:
        b.next.prev = b.prev
    if b.older != NULL:
        b.older.newer = b.newer
    else:
        p.oldest = b.newer
    if b.newer != NULL:
        b.newer.older = b.older
    else:
        p.newest = b.older
    p.cached_bytes -= b.tail.size
    p.cached_blocks -= 1


cdef block_t* _evict_to(pool_t* p, size_t limit) noexcept nogil:
    """Uncache the oldest blocks until at most `limit` bytes stay cached; the evicted
    blocks, chained by `next`, for the caller to free after unlocking."""
    cdef block_t* out = NULL
    cdef block_t* b
    while p.cached_bytes > limit:
        b = p.oldest
        _unlink(p, b, _find(p, b.tail.size))
        b.next = out
        out = b
        p.evictions += 1
    return out


cdef void _release(block_t* chain) noexcept nogil:
    """Give a chain of blocks (by `next`) back to the system."""
    cdef block_t* b
    while chain != NULL:
        b = chain
        chain = b.next
        free(<char*>b + sizeof(block_t) - b.tail.offset)


# ---------------------------------------------------------------------------------------
# the allocator
# ---------------------------------------------------------------------------------------
cdef inline tail_t* _tail(void* data) noexcept nogil:
    return <tail_t*>(<char*>data - sizeof(tail_t))


cdef void* _small(size_t size, bint zero) noexcept nogil:
    cdef char* base = <char*>(calloc(1, size + SMALL_HEADER) if zero
                              else malloc(size + SMALL_HEADER))
    if base == NULL:
        return NULL
    cdef tail_t* t = <tail_t*>base
    t.size = size
    t.offset = SMALL_HEADER
    return base + SMALL_HEADER


cdef void* _fresh(size_t cls, bint zero, bint huge) noexcept nogil:
    """A new large block of `cls` bytes from the system (zeroed when `zero`: calloc,
    whose fresh pages need no memset); with `huge`, a block of 4 MiB or more is advised
    to use transparent huge pages, as numpy's default allocator does."""
    cdef size_t total = cls + sizeof(block_t) + ALIGN
    cdef char* base = <char*>(calloc(1, total) if zero else malloc(total))
    if base == NULL:
        return NULL
    cdef char* data = <char*>((<uintptr_t>base + sizeof(block_t) + ALIGN - 1)
                              & ~<uintptr_t>(ALIGN - 1))
    cdef tail_t* t = _tail(data)
    t.size = cls
    t.offset = <size_t>(data - base)
    cdef uintptr_t lo
    if huge and cls >= HUGE_BLOCK:
        lo = (<uintptr_t>data + SYS_PAGE - 1) & ~<uintptr_t>(SYS_PAGE - 1)
        madvise(<void*>lo, (<uintptr_t>data + cls - lo) & ~<uintptr_t>(SYS_PAGE - 1),
                MADV_HUGEPAGE)              # (advice only: a failure changes nothing)
    return data


cdef void* _pool_alloc(pool_t* p, size_t size, bint zero) noexcept nogil:
    """`size` bytes (zeroed when `zero`): a small block, a cached block of the class, or
    a new block."""
    if size < p.min_block:
        return _small(size, zero)
    cdef size_t cls = _class(p, size)
    cdef block_t* b = NULL
    cdef block_t* chain
    cdef class_t* c
    cdef void* data
    pthread_mutex_lock(&p.lock)
    c = _find(p, cls)
    if c != NULL and c.head != NULL:
        b = c.head
        _unlink(p, b, c)
        p.hits += 1
    else:
        p.misses += 1
    p.active_bytes += cls
    p.active_blocks += 1
    if p.active_bytes > p.peak_active_bytes:
        p.peak_active_bytes = p.active_bytes
    pthread_mutex_unlock(&p.lock)
    if b != NULL:
        data = <char*>b + sizeof(block_t)
        if zero:
            memset(data, 0, size)
        return data
    data = _fresh(cls, zero, p.hugepages)
    if data == NULL:
        # out of memory: give every cached block back and try once more
        pthread_mutex_lock(&p.lock)
        chain = _evict_to(p, 0)
        pthread_mutex_unlock(&p.lock)
        _release(chain)
        data = _fresh(cls, zero, p.hugepages)
        if data == NULL:
            pthread_mutex_lock(&p.lock)
            p.active_bytes -= cls
            p.active_blocks -= 1
            pthread_mutex_unlock(&p.lock)
    return data


cdef void _pool_free(pool_t* p, void* data) noexcept nogil:
    """Give `data` back: small blocks to the system, large ones to their class list
    (evicting the oldest cached blocks beyond the cap)."""
    if data == NULL:
        return
    cdef tail_t* t = _tail(data)
    if t.offset == SMALL_HEADER:
        free(<char*>data - SMALL_HEADER)
        return
    cdef block_t* b = <block_t*>(<char*>data - sizeof(block_t))
    cdef size_t cls = t.size
    cdef block_t* chain = NULL
    cdef class_t* c = NULL
    pthread_mutex_lock(&p.lock)
    p.active_bytes -= cls
    p.active_blocks -= 1
    if cls > p.cap:
        p.oversize += 1
    else:
        chain = _evict_to(p, p.cap - cls)
        c = _find_or_add(p, cls)
    if c != NULL:
        b.prev = NULL
        b.next = c.head
        if c.head != NULL:
            c.head.prev = b
        c.head = b
        b.newer = NULL
        b.older = p.newest
        if p.newest != NULL:
            p.newest.newer = b
        else:
            p.oldest = b
        p.newest = b
        p.cached_bytes += cls
        p.cached_blocks += 1
        if p.cached_bytes > p.peak_cached_bytes:
            p.peak_cached_bytes = p.cached_bytes
    pthread_mutex_unlock(&p.lock)
    if c == NULL:
        b.next = chain
        chain = b
    _release(chain)


cdef void* _pool_realloc(pool_t* p, void* data, size_t size) noexcept nogil:
    """`data` resized to `size` bytes, contents kept: a small block stays small by
    realloc; a large block whose class does not change is returned as it is; otherwise
    a new block (from the pool) receives the contents and `data` is freed."""
    if data == NULL:
        return _pool_alloc(p, size, False)
    cdef tail_t* t = _tail(data)
    cdef char* base
    cdef void* out
    if t.offset == SMALL_HEADER and size < p.min_block:
        base = <char*>realloc(<char*>data - SMALL_HEADER, size + SMALL_HEADER)
        if base == NULL:
            return NULL
        (<tail_t*>base).size = size
        return base + SMALL_HEADER
    if t.offset != SMALL_HEADER and size >= p.min_block and \
            _class(p, size) == t.size:
        return data
    out = _pool_alloc(p, size, False)
    if out == NULL:
        return NULL
    memcpy(out, data, size if size < t.size else t.size)
    _pool_free(p, data)
    return out


# numpy's handler functions: ctx is the pool
cdef void* _h_malloc(void* ctx, size_t size) noexcept nogil:
    return _pool_alloc(<pool_t*>ctx, size, False)


cdef void* _h_calloc(void* ctx, size_t nelem, size_t elsize) noexcept nogil:
    if elsize != 0 and nelem > <size_t>-1 // elsize:
        return NULL
    return _pool_alloc(<pool_t*>ctx, nelem * elsize, True)


cdef void* _h_realloc(void* ctx, void* ptr, size_t new_size) noexcept nogil:
    return _pool_realloc(<pool_t*>ctx, ptr, new_size)


cdef void _h_free(void* ctx, void* ptr, size_t size) noexcept nogil:
    _pool_free(<pool_t*>ctx, ptr)       # the block's own header knows its size


cdef void _destroy(object capsule) noexcept:
    """The capsule's destructor: the last array made by the pool and the Pool object
    are gone; give the cached blocks back and free the pool."""
    cdef PyDataMem_Handler* h = <PyDataMem_Handler*>PyCapsule_GetPointer(capsule,
                                                                         CAPSULE_NAME)
    cdef pool_t* p = <pool_t*>h.allocator.ctx
    _release(_evict_to(p, 0))
    pthread_mutex_destroy(&p.lock)
    free(p.table)
    free(p)
    free(h)


def _check_size(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Pool: {name} must be an int >= {low}, got {value!r}")
    return value


cdef class Pool:
    """A caching pool of array-data blocks (see the module docstring).

    Parameters
    ----------
    min_block : int
        Requests of at least this many bytes are pooled (default 64 KiB); smaller ones
        go to malloc/free.
    max_cached_bytes : int
        At most this many bytes stay cached (default 1 GiB; 0 caches nothing).
    page : int
        Size classes are multiples of it (default 4096, a power of two).
    hugepages : bool
        New blocks of 4 MiB or more are advised to use transparent huge pages (default
        True, as numpy's default allocator).
    """
    cdef pool_t* p
    cdef readonly object handler         # numpy's "mem_handler" capsule; owns `p`
    cdef public bint enabled             # False: installed() and calling() do nothing

    def __cinit__(self, min_block=1 << 16, max_cached_bytes=1 << 30, page=4096,
                  hugepages=True):
        _check_size("min_block", min_block, 1)
        _check_size("max_cached_bytes", max_cached_bytes, 0)
        _check_size("page", page, 1)
        if page & (page - 1):
            raise ValueError(f"Pool: page must be a power of two, got {page!r}")
        cdef PyDataMem_Handler* h = <PyDataMem_Handler*>calloc(1, sizeof(PyDataMem_Handler))
        cdef pool_t* p = <pool_t*>calloc(1, sizeof(pool_t))
        cdef class_t* t = <class_t*>calloc(MIN_TABLE, sizeof(class_t))
        if h == NULL or p == NULL or t == NULL:
            free(h)
            free(p)
            free(t)
            raise MemoryError("Pool: out of memory")
        pthread_mutex_init(&p.lock, NULL)
        p.min_block, p.page, p.cap = min_block, page, max_cached_bytes
        p.hugepages = bool(hugepages)
        p.table, p.table_slots = t, MIN_TABLE
        strncpy(h.name, b"dualmode_buffer_pool", 126)
        h.version = 1
        h.allocator.ctx = p
        h.allocator.malloc = _h_malloc
        h.allocator.calloc = _h_calloc
        h.allocator.realloc = _h_realloc
        h.allocator.free = _h_free
        self.handler = PyCapsule_New(h, CAPSULE_NAME, _destroy)
        self.p = p
        self.enabled = True

    @property
    def min_block(self):
        return self.p.min_block

    @property
    def page(self):
        return self.p.page

    @property
    def max_cached_bytes(self):
        """The cap on cached bytes; lowering it gives the oldest blocks back at once."""
        return self.p.cap

    @max_cached_bytes.setter
    def max_cached_bytes(self, value):
        cdef size_t cap = _check_size("max_cached_bytes", value, 0)
        cdef block_t* chain
        cdef pool_t* p = self.p
        with nogil:
            pthread_mutex_lock(&p.lock)
            p.cap = cap
            chain = _evict_to(p, p.cap)
            pthread_mutex_unlock(&p.lock)
            _release(chain)

    def installed(self):
        """A context manager: this pool serves numpy's array data in the current
        context inside the ``with`` block (while `enabled`)."""
        return Installed(self)

    def calling(self, fn):
        """`fn` wrapped: each call runs with this pool serving numpy's array data in
        the current context (while `enabled`), as inside :meth:`installed`, for less
        than a ``with`` block costs (a hook called once per op)."""
        return Calling(self, fn)

    def empty_cache(self):
        """Give every cached block back to the system (blocks in use stay in use)."""
        cdef block_t* chain
        cdef pool_t* p = self.p
        cdef size_t evictions
        with nogil:
            pthread_mutex_lock(&p.lock)
            evictions = p.evictions
            chain = _evict_to(p, 0)
            p.evictions = evictions         # emptying the cache is not an eviction
            pthread_mutex_unlock(&p.lock)
            _release(chain)

    def stats(self):
        """Counts of large-block requests and bytes: ``hits`` (served from the cache),
        ``misses`` (new blocks), ``evictions`` (cached blocks given back for the cap),
        ``oversize`` (freed blocks larger than the cap), ``cached_bytes``,
        ``cached_blocks``, ``peak_cached_bytes``, ``active_bytes``, ``active_blocks``
        (handed out, not yet freed), ``peak_active_bytes``."""
        cdef pool_t* p = self.p
        cdef pool_t copy
        with nogil:                 # (copied under the lock; the dict is made after it)
            pthread_mutex_lock(&p.lock)
            memcpy(&copy, p, sizeof(pool_t))
            pthread_mutex_unlock(&p.lock)
        return dict(hits=copy.hits, misses=copy.misses, evictions=copy.evictions,
                    oversize=copy.oversize, cached_bytes=copy.cached_bytes,
                    cached_blocks=copy.cached_blocks,
                    peak_cached_bytes=copy.peak_cached_bytes,
                    active_bytes=copy.active_bytes, active_blocks=copy.active_blocks,
                    peak_active_bytes=copy.peak_active_bytes)

    def reset_stats(self):
        """Zero the counters; the peaks restart from the current bytes."""
        cdef pool_t* p = self.p
        with nogil:
            pthread_mutex_lock(&p.lock)
            p.hits = p.misses = p.evictions = p.oversize = 0
            p.peak_cached_bytes = p.cached_bytes
            p.peak_active_bytes = p.active_bytes
            pthread_mutex_unlock(&p.lock)

    # raw blocks, for tests: addresses as ints; free them before the Pool goes away
    def malloc(self, size_t size):
        """The address of a new block of `size` bytes (0 when out of memory)."""
        return <uintptr_t>_pool_alloc(self.p, size, False)

    def calloc(self, size_t nelem, size_t elsize):
        """The address of a new zeroed block of ``nelem * elsize`` bytes."""
        return <uintptr_t>_h_calloc(self.p, nelem, elsize)

    def realloc(self, uintptr_t address, size_t size):
        """The address of block `address` resized to `size` bytes, contents kept."""
        return <uintptr_t>_pool_realloc(self.p, <void*>address, size)

    def free(self, uintptr_t address):
        """Give block `address` back."""
        _pool_free(self.p, <void*>address)

    def block_size(self, uintptr_t address):
        """The usable bytes of block `address`: its size class, or its request (small)."""
        return _tail(<void*>address).size


cdef class Installed:
    """The pool as numpy's data-memory handler for the current context while inside the
    ``with`` block (the previous handler restored on exit); nothing while the pool is
    not `enabled`."""
    cdef Pool pool
    cdef object previous

    def __cinit__(self, Pool pool):
        self.pool = pool

    def __enter__(self):
        if self.previous is not None:
            raise RuntimeError("Pool.installed(): this context is already entered")
        if self.pool.enabled:
            self.previous = PyDataMem_SetHandler(self.pool.handler)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            PyDataMem_SetHandler(self.previous)
            self.previous = None
        return False


cdef class Calling:
    """`fn` called with the pool installed for the call (see :meth:`Pool.calling`)."""
    cdef Pool pool
    cdef readonly object fn

    def __cinit__(self, Pool pool, fn):
        self.pool = pool
        self.fn = fn

    def __call__(self, *args):
        if not self.pool.enabled:
            return self.fn(*args)
        previous = PyDataMem_SetHandler(self.pool.handler)
        try:
            return self.fn(*args)
        finally:
            PyDataMem_SetHandler(previous)


def current_handler():
    """numpy's data-memory handler capsule of the current context."""
    return PyDataMem_GetHandler()


#: the process's pool; never freed, so its blocks outlive any module teardown
_DEFAULT = Pool()
Py_INCREF(_DEFAULT)


def default_pool():
    """The process-wide :class:`Pool` (graph mode's buffers)."""
    return _DEFAULT
