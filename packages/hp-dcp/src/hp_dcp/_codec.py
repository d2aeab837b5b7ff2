"""Non-tensor values stored as data: a tagged JSON encoding that loading can never turn into
code (unlike pickle, which runs whatever a crafted checkpoint asks for).

Encodable: None, bools, ints, floats (non-finite ones too), strings, bytes, lists, tuples, dicts
(keys of any encodable kind), NumPy arrays and scalars of numeric or bool dtypes. JSON natives
stand for themselves, except that every dict, tuple, non-finite float, bytes value and NumPy
value is a one-key object ``{"$d": ...}``, ``{"$t": ...}``, ``{"$f": ...}``, ``{"$b": ...}``,
``{"$nd": ...}``, ``{"$ns": ...}``, so nothing is ambiguous and the types round-trip.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

__all__ = ["CodecError", "decode", "encode"]


class CodecError(ValueError):
    """A value that cannot be stored as data, or bytes that are not an encoded value."""


def encode(value: Any) -> bytes:
    """``value`` as UTF-8 JSON bytes; raises :class:`CodecError` naming the first part that is
    not data (with its path in the value)."""
    return json.dumps(_enc(value, "value"), separators=(",", ":"), allow_nan=False).encode()


def decode(blob: bytes) -> Any:
    """The value :func:`encode` encoded."""
    try:
        doc = json.loads(bytes(blob).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CodecError(f"not an encoded value ({e})") from None
    return _dec(doc)


def _enc(v: Any, path: str) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    numpy = _numpy_value(v, path)  # before float: numpy.float64 is a float subclass
    if numpy is not None:
        return numpy
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v) if math.isfinite(v) else {"$f": repr(float(v))}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"$b": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, tuple):  # torch.Size too
        return {"$t": [_enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [_enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        return {"$d": [[_enc(k, f"{path} key"), _enc(x, f"{path}[{k!r}]")] for k, x in v.items()]}
    raise CodecError(
        f"{path}: a {type(v).__module__}.{type(v).__qualname__} cannot be stored as data; "
        "store numbers, strings, bytes, lists, tuples, dicts, NumPy arrays, or tensors"
    )


def _numpy_value(v: Any, path: str) -> dict | None:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - NumPy is optional
        return None
    if isinstance(v, (np.ndarray, np.generic)):
        if v.dtype.kind not in "biufc":
            raise CodecError(
                f"{path}: a NumPy value of dtype {v.dtype} cannot be stored as data (numeric "
                "and bool dtypes only)"
            )
        a = np.asarray(v)  # tobytes() is C-ordered whatever the strides
        body = [v.dtype.str, list(a.shape), base64.b64encode(a.tobytes()).decode()]
        return {"$nd" if isinstance(v, np.ndarray) else "$ns": body}
    return None


_TAGS = {"$d", "$t", "$f", "$b", "$nd", "$ns"}


def _dec(d: Any) -> Any:
    if isinstance(d, list):
        return [_dec(x) for x in d]
    if not isinstance(d, dict):
        return d
    if len(d) != 1 or next(iter(d)) not in _TAGS:
        raise CodecError(f"not an encoded value: an object with keys {sorted(d)[:4]}")
    tag, body = next(iter(d.items()))
    if tag == "$d":
        return {_dec(k): _dec(x) for k, x in body}
    if tag == "$t":
        return tuple(_dec(x) for x in body)
    if tag == "$f":
        if body not in ("nan", "inf", "-inf"):
            raise CodecError(f"not an encoded float: {body!r}")
        return float(body)
    if tag == "$b":
        return base64.b64decode(body)
    import numpy as np

    dtype, shape, data = body
    dt = np.dtype(dtype)
    if dt.kind not in "biufc":
        raise CodecError(f"not an encoded NumPy value: dtype {dtype!r}")
    a = np.frombuffer(base64.b64decode(data), dtype=dt).reshape(shape).copy()
    return a if tag == "$nd" else a[()]
