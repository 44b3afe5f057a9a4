"""Graph mode: trace a function into an IR, compile it (strategies, sharding
propagation, redistribution and communication planning, fusion) and execute it on
the backend's local shards.

    trace.py       run the function on abstract values; every op call becomes a node
    ir.py          the immutable IR (Value, Node, Graph) and its verifier
    candidates.py  candidate strategies per op, from the op's sharding rule
    cost.py        the alpha-beta cost model of collectives and redistributions
    propagate.py   sharding propagation (Cython kernel + Python reference)
    compile.py     the passes, and CompiledGraph (strategies(), dump(), the executor)
    api.py         ops.shard, Cell.shard, AutoParallel, GRAPH_MODE, compile_count
"""
