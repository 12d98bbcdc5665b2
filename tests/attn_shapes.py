"""Head dims per attention path for the attention tests: the avx512_bf16 path takes head_dim a
multiple of 32 (BF16 pairs of 32 columns; the dispatcher gives other head dims the avx512 kernels),
so a test shape with another head_dim runs that path at the next multiple of 32 (24 -> 32: one
32-column step; 72 -> 96: 64 + 32), still covering each column split of its V pass."""

HEAD_DIM_MULTIPLE = {"avx512_bf16": 32}


def head_dim_for(path, head_dim):
    k = HEAD_DIM_MULTIPLE.get(path, 8)
    return -(-head_dim // k) * k


def shape_for(path, shape):
    """(n_heads, kv_heads, head_dim) with the head_dim `path` takes."""
    n_heads, kv_heads, head_dim = shape
    return n_heads, kv_heads, head_dim_for(path, head_dim)
