"""Scaled dot-product attention and the decode step over a KV cache, in NumPy.

Shape legend (used in every shape comment of this project):
    B     batch size (sequences decoded together)
    H     query heads
    H_kv  key/value heads (H_kv == H: multi-head; 1 < H_kv < H: grouped-query; H_kv == 1: multi-query)
    G     query heads per KV head, H // H_kv
    T     cached positions (keys/values in the KV cache); Tq query positions, Tk key positions
    D     head dim (D_k for queries/keys, D_v for values); D_model the model width

Decoding one token attends a `[B, H, 1, D]` query over `[B, H_kv, T, D]` cached keys and values. Each
sequence only ever sees its own cache: the batch dims are batch dims of `@`, never mixed (the oracle
tests feed every sequence different data to prove it).

Formula: Attention(Q, K, V) = softmax(Q K^T / sqrt(D_k)) V  (Vaswani et al., 2017, eq. 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from attention_kv_caceh.cache import KVCache

__all__ = [
    "causal_mask",
    "decode_step",
    "multihead_decode_step",
    "scaled_dot_product_attention",
    "softmax",
]

FloatArray = npt.NDArray[np.floating[Any]]
BoolArray = npt.NDArray[np.bool_]

# Above this many elements in one head's K (or V) block, Tk x D, the two products go through kernels that
# stream long K/V at close to the machine's read bandwidth: `np.vecdot` for the scores of a single query
# row, `np.einsum` otherwise. NumPy's stacked `matmul` does not call BLAS for these matrix-vector shapes
# and reads at about half that (measured with `attention-kv-caceh --seq-len 4096 --head-dim 128 ...`).
# Below it, `@` has the lower call overhead, which is what short caches are dominated by.
_STREAM_MIN_ELEMENTS = 1 << 17


def _require_float(name: str, x: npt.NDArray[Any]) -> None:
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {x.dtype} with shape {x.shape}")


def _as_array(name: str, x: object) -> npt.NDArray[Any]:
    """`np.asarray(x)` (lists and other array-likes are converted; a list of Python floats becomes
    float64), raising ValueError naming `name` for what NumPy cannot turn into one array (ragged lists)."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} cannot be converted to an array: {exc}") from None


def _compute_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype arithmetic runs in: float16 (and any float narrower than 32 bits) is widened to
    float32, whose range holds logits float16 would overflow to inf; wider floats are kept."""
    return np.promote_types(dtype, np.float32)


def softmax(x: FloatArray, axis: int = -1) -> FloatArray:
    """Numerically stable softmax along `axis`; output has the input's shape and floating dtype.

    Subtracts the slice maximum before `exp`, so logits of 1e4 do not overflow. float16 input is
    computed in float32 and the result cast back to float16 (the sum of many float16 terms would lose
    precision). What special slices give:
    - a slice that is entirely `-inf` (a fully masked query row): zeros, with no NaN and no
      RuntimeWarning;
    - an empty slice (size 0 along `axis`, e.g. no keys at all): an empty result, no error;
    - a slice holding `+inf` or NaN: NaN throughout that slice (such logits have no softmax), with no
      RuntimeWarning; the other slices are unaffected.

    Raises ValueError for a non-floating dtype or an axis out of range.
    """
    x = np.asarray(x)
    _require_float("x", x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for x of shape {x.shape}")
    if x.shape[axis] == 0:
        return np.zeros(x.shape, dtype=x.dtype)  # nothing to normalise; np.max would refuse it
    work = x.astype(_compute_dtype(x.dtype), copy=False)  # float16 -> float32; no copy otherwise
    m = np.max(work, axis=axis, keepdims=True)  # same shape as x, size 1 along axis (a new array)
    m[np.isneginf(m)] = 0  # a fully masked row: shift by 0, so exp(-inf) = 0 without inf - inf
    with np.errstate(invalid="ignore"):  # +inf - +inf in a slice holding +inf: NaN, handled below
        e = np.subtract(work, m)  # <= 0 everywhere, so exp cannot overflow
    np.exp(e, out=e)
    denom = np.sum(e, axis=axis, keepdims=True)
    # Fully masked rows have e == 0 and denom == 0: skip them instead of computing 0/0.
    np.divide(e, denom, out=e, where=denom > 0)
    undefined = np.isnan(denom)  # the slice held NaN or +inf
    if undefined.any():
        e[np.broadcast_to(undefined, e.shape)] = np.nan  # the whole slice, not a partly divided one
    return e.astype(x.dtype, copy=False)


def causal_mask(tq: int, tk: int) -> BoolArray:
    """Boolean `[Tq, Tk]` mask, True = attend, aligned bottom-right (the decoding convention).

    Query i (0-based, of Tq) sees keys 0 .. Tk - Tq + i: the last query row sees every key, which is what
    a decode step against a cache of Tk - Tq earlier positions needs. PyTorch's
    `scaled_dot_product_attention(is_causal=True)` is aligned top-left instead (query i sees keys 0 .. i)
    and so differs from this whenever Tq != Tk.

    Raises ValueError for negative sizes.
    """
    if tq < 0 or tk < 0:
        raise ValueError(f"mask sizes must be >= 0, got Tq={tq}, Tk={tk}")
    rows = np.arange(tq)[:, None]  # [Tq, 1]
    cols = np.arange(tk)[None, :]  # [1, Tk]
    return cols <= rows + (tk - tq)  # [Tq, Tk]


def _check_qkv(q: FloatArray, k: FloatArray, v: FloatArray) -> tuple[list[int], int, int, int, int, int, int]:
    """The shapes of q, k, v checked against each other: (lead dims of q, Tq, D_k, Tk, D_v, H_kv, G).

    Raises ValueError as `scaled_dot_product_attention` documents."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require_float(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims [..., T, D], got shape {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must have the same rank, got {q.shape}, {k.shape}, {v.shape}")
    *lead_q, tq, dk = q.shape
    *lead_k, tk, dk_k = k.shape
    *lead_v, tk_v, dv = v.shape
    if dk != dk_k:
        raise ValueError(f"q and k head dims differ: q {q.shape}, k {k.shape}")
    if dk == 0:
        raise ValueError(f"q and k need a head dim D_k >= 1, got q {q.shape}, k {k.shape}")
    if lead_k != lead_v or tk != tk_v:
        raise ValueError(f"k and v must agree on batch dims and Tk: k {k.shape}, v {v.shape}")
    if q.ndim < 4:
        if lead_q != lead_k:
            raise ValueError(f"q and k batch dims differ: q {q.shape}, k {k.shape}")
        return lead_q, tq, dk, tk, dv, 1, 1
    h, h_kv = lead_q[-1], lead_k[-1]
    if lead_q[:-1] != lead_k[:-1]:
        raise ValueError(f"q and k batch dims differ: q {q.shape}, k {k.shape}")
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(
            f"query heads H={h} must be a multiple of KV heads H_kv={h_kv} (q {q.shape}, k {k.shape})"
        )
    return lead_q, tq, dk, tk, dv, h_kv, h // h_kv


def _keep_mask(
    mask: BoolArray | None, is_causal: bool, tq: int, tk: int, weights_shape: tuple[int, ...]
) -> BoolArray | None:
    """The positions that may be attended (True), from `mask` and `is_causal` together; None: all.

    Raises ValueError for a mask that is not boolean or does not broadcast to `weights_shape`."""
    keep: BoolArray | None = causal_mask(tq, tk) if is_causal else None  # [Tq, Tk]
    if mask is None:
        return keep
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise ValueError(f"mask must be boolean (True = attend), got dtype {mask.dtype}")
    try:
        fits = np.broadcast_shapes(mask.shape, weights_shape) == weights_shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to weights {weights_shape}")
    return mask if keep is None else (keep & mask)


def scaled_dot_product_attention(
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    *,
    mask: BoolArray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[FloatArray, FloatArray]:
    """softmax(q k^T * scale [masked]) v, returning `(output, weights)`.

    Shapes: q `[..., Tq, D_k]`, k `[..., Tk, D_k]`, v `[..., Tk, D_v]` -> output `[..., Tq, D_v]`,
    weights `[..., Tq, Tk]`. Leading dims are batch dims and must match between q, k and v, with one
    exception: for 4-D or higher inputs `[..., H, T, D]` the head axis (-3) of k/v may have H_kv heads
    where H % H_kv == 0 (grouped-query attention, GQA; Ainslie et al., 2023). Query head h then reads
    KV head h // (H // H_kv). K/V are never repeated in memory: the G = H // H_kv query heads of a group
    are stacked as rows of one matrix, so each KV head is read once per call.

    mask: boolean, True = attend, broadcastable to the weights `[..., H, Tq, Tk]`.
    is_causal: bottom-right aligned causal mask (see `causal_mask`); combined with `mask` by AND.
    scale: defaults to 1 / sqrt(D_k). A query row that may attend nothing (every key masked, or no keys
    at all, Tk = 0) gets zero weights and a zero output.

    dtype: all of q, k, v must share one floating dtype, which the results keep (float32 stays float32:
    the scale is cast to the compute dtype, so NumPy 2's promotion by a float64 scalar cannot widen it).
    float16 inputs are computed in float32 and the results cast back to float16: float16 scores
    overflow to inf from about 6.5e4, and inf - inf in the softmax would give NaN. This reads K and V
    as float32 copies, twice their float16 bytes.

    Raises ValueError for non-floating or mismatched dtypes, wrong ranks, mismatched batch dims, head
    dims, key lengths, heads not divisible, a mask that does not broadcast, or D_k = 0 (a dot product of
    length zero carries no information and 1 / sqrt(D_k) is undefined). Array-likes (lists) are
    converted with `np.asarray`.
    """
    q, k, v = _as_array("q", q), _as_array("k", k), _as_array("v", v)
    lead_q, tq, dk, tk, dv, h_kv, g = _check_qkv(q, k, v)
    weights_shape = (*lead_q, tq, tk)
    keep = _keep_mask(mask, is_causal, tq, tk, weights_shape)

    out_dtype = q.dtype
    work = _compute_dtype(out_dtype)
    q, k, v = q.astype(work, copy=False), k.astype(work, copy=False), v.astype(work, copy=False)
    dtype: type[np.floating[Any]] = work.type
    s = dtype(1.0 / np.sqrt(dk)) if scale is None else dtype(scale)

    # GQA: the G query heads of each KV head become rows of one matrix, [..., H_kv, G*Tq, D_k].
    q_rows = q.reshape(*lead_q[:-1], h_kv, g * tq, dk) if q.ndim >= 4 else q
    # scores = (q * s) K^T: [..., H_kv, G*Tq, D_k] x [..., H_kv, Tk, D_k] -> [..., H_kv, G*Tq, Tk]
    stream = tk * max(dk, dv) >= _STREAM_MIN_ELEMENTS
    rows = q_rows.shape[-2]  # G*Tq query rows per KV head
    if stream and rows == 1:
        scores = np.vecdot(k, q_rows * s)[..., None, :]  # one dot of length D_k per key -> [..., 1, Tk]
    elif stream:
        scores = np.einsum("...qd,...td->...qt", q_rows * s, k)
    else:
        scores = (q_rows * s) @ np.swapaxes(k, -1, -2)
    scores = scores.reshape(weights_shape)  # [..., H, Tq, Tk]

    if keep is not None:
        scores = np.where(keep, scores, dtype(-np.inf))  # [..., H, Tq, Tk]

    weights = softmax(scores, axis=-1)  # [..., H, Tq, Tk], each row sums to 1 (or is all 0)
    w_rows = weights.reshape(*lead_q[:-1], h_kv, g * tq, tk) if q.ndim >= 4 else weights
    # output = weights V: [..., H_kv, G*Tq, Tk] x [..., H_kv, Tk, D_v] -> [..., H_kv, G*Tq, D_v]
    out = np.einsum("...qt,...td->...qd", w_rows, v) if stream else w_rows @ v
    out = out.reshape(*lead_q, tq, dv)  # [..., H, Tq, D_v]
    return out.astype(out_dtype, copy=False), weights.astype(out_dtype, copy=False)


def decode_step(
    x_t: FloatArray,
    w_q: FloatArray,
    w_k: FloatArray,
    w_v: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """One single-head decode step with the Dynamic Cache path (np.concatenate per step).

    x_t `[B, 1, D_model]`, w_q and w_k `[D_model, D_k]`, w_v `[D_model, D_v]`, k_cache `[B, T, D_k]`,
    v_cache `[B, T, D_v]` with T >= 0. Projects x_t, appends the new key and value with
    `np.concatenate` (a new array every step: the copy a Preallocated cache avoids), attends over T+1
    positions and returns `(output [B, 1, D_v], weights [B, 1, T+1], k_cache [B, T+1, D_k],
    v_cache [B, T+1, D_v])`. The input caches are not modified.

    Array-likes (lists) are converted with `np.asarray` (a list of Python floats becomes float64) and
    must then share the other inputs' dtype. Raises ValueError for non-floating or mixed dtypes, input
    that is not one array, and any mismatched shape (named in the message).
    """
    x_t, w_q, w_k, w_v = (
        _as_array("x_t", x_t),
        _as_array("w_q", w_q),
        _as_array("w_k", w_k),
        _as_array("w_v", w_v),
    )
    k_cache, v_cache = _as_array("k_cache", k_cache), _as_array("v_cache", v_cache)
    arrays = {
        "x_t": x_t,
        "w_q": w_q,
        "w_k": w_k,
        "w_v": w_v,
        "k_cache": k_cache,
        "v_cache": v_cache,
    }
    for name, arr in arrays.items():
        _require_float(name, arr)
    dtypes = {str(a.dtype) for a in arrays.values()}
    if len(dtypes) != 1:
        raise ValueError(f"all inputs must share one dtype, got {sorted(dtypes)}")
    if x_t.ndim != 3 or x_t.shape[1] != 1:
        raise ValueError(f"x_t must be [B, 1, D_model], got shape {x_t.shape}")
    b, _, d_model = x_t.shape
    if b < 1 or d_model < 1:
        raise ValueError(f"x_t must have B >= 1 and D_model >= 1, got shape {x_t.shape}")
    for name, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v)):
        if w.ndim != 2 or w.shape[0] != d_model:
            raise ValueError(f"{name} must be [D_model={d_model}, D], got shape {w.shape}")
    if w_q.shape[1] != w_k.shape[1]:
        raise ValueError(f"w_q and w_k must give the same D_k, got {w_q.shape} and {w_k.shape}")
    if w_k.shape[1] == 0:
        raise ValueError(f"w_q and w_k must give D_k >= 1, got {w_q.shape} and {w_k.shape}")
    d_k, d_v = w_k.shape[1], w_v.shape[1]
    if k_cache.ndim != 3 or k_cache.shape[0] != b or k_cache.shape[2] != d_k:
        raise ValueError(f"k_cache must be [B={b}, T, D_k={d_k}], got shape {k_cache.shape}")
    if v_cache.shape != (b, k_cache.shape[1], d_v):
        raise ValueError(
            f"v_cache must be [B={b}, T={k_cache.shape[1]}, D_v={d_v}], got shape {v_cache.shape}"
        )

    q_t = x_t @ w_q  # [B, 1, D_model] @ [D_model, D_k] -> [B, 1, D_k]
    k_t = x_t @ w_k  # [B, 1, D_k]
    v_t = x_t @ w_v  # [B, 1, D_v]
    k_cache = np.concatenate([k_cache, k_t], axis=1)  # [B, T+1, D_k], a fresh copy
    v_cache = np.concatenate([v_cache, v_t], axis=1)  # [B, T+1, D_v]
    output, weights = scaled_dot_product_attention(q_t, k_cache, v_cache)  # [B,1,D_v], [B,1,T+1]
    return output, weights, k_cache, v_cache


def multihead_decode_step(
    q_t: FloatArray,
    k_t: FloatArray,
    v_t: FloatArray,
    cache: KVCache,
) -> tuple[FloatArray, FloatArray]:
    """Append one position to `cache` and attend the new query over every cached position.

    q_t `[B, H, 1, D]`, k_t and v_t `[B, H_kv, 1, D]` (already projected, and rotated where a model uses
    RoPE); `cache` is a DynamicKVCache or PreallocatedKVCache holding T positions. Returns
    `(output [B, H, 1, D], weights [B, H, 1, T+1])`; the cache then holds T+1 positions. H % H_kv == 0
    (grouped-query attention is handled without repeating K/V).

    Everything is validated before the cache is touched: a call that raises leaves the cache exactly as
    it was (length and contents). Array-likes (lists) are converted with `np.asarray` (a list of Python
    floats becomes float64, which must then match the cache dtype).

    Raises ValueError for input that is not one floating array, q_t/k_t/v_t of different dtypes, any
    mismatched shape (B, D, one position, H % H_kv), a shape or dtype that does not match the cache, and
    CacheCapacityError (a ValueError) when a Preallocated cache is full.
    """
    q_t, k_t, v_t = _as_array("q_t", q_t), _as_array("k_t", k_t), _as_array("v_t", v_t)
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        _require_float(name, x)
    if not q_t.dtype == k_t.dtype == v_t.dtype:
        raise ValueError(f"q_t, k_t, v_t must share a dtype, got {q_t.dtype}, {k_t.dtype}, {v_t.dtype}")
    if q_t.ndim != 4 or q_t.shape[2] != 1:
        raise ValueError(f"q_t must be [B, H, 1, D], got shape {q_t.shape}")
    b, h, _, d = q_t.shape
    if k_t.ndim != 4 or k_t.shape[2] != 1 or k_t.shape[0] != b or k_t.shape[3] != d:
        raise ValueError(
            f"k_t must be [B={b}, H_kv, 1, D={d}] to match q_t {q_t.shape}, got shape {k_t.shape}"
        )
    if v_t.shape != k_t.shape:
        raise ValueError(f"v_t must have k_t's shape {k_t.shape}, got shape {v_t.shape}")
    h_kv = k_t.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(
            f"query heads H={h} must be a multiple of KV heads H_kv={h_kv} (q_t {q_t.shape}, k_t {k_t.shape})"
        )
    if d == 0:
        raise ValueError(f"q_t needs a head dim D >= 1, got shape {q_t.shape}")
    # The cache checks k_t/v_t against its own B, H_kv, D, dtype and capacity before writing anything;
    # with the checks above the attention below cannot fail.
    keys, values = cache.append(k_t, v_t)  # [B, H_kv, T+1, D] each
    return scaled_dot_product_attention(q_t, keys, values)  # [B, H, 1, D], [B, H, 1, T+1]
