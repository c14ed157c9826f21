"""``JaggedTensor``: a ragged batch as (values, offsets), with padded / nested / fbgemm conversions."""

from __future__ import annotations

import torch

from .offsets import bounded_offsets, checked_lengths, lengths_of, max_length, offsets_from_lengths, validate_offsets

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
# fbgemm's and aten's jagged ops reject fp8: such payloads travel bit-exactly as an int32 view.
_FP8_CARRIER = torch.int32


def _carrier_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flatten trailing dims to ``[rows, F]``; fp8 bytes become int32 words (F divisible by 4)."""
    flat = x.reshape(x.shape[0], -1) if x.dim() != 2 else x
    if x.dtype in FP8_DTYPES:
        if flat.shape[1] % 4:
            raise ValueError(f"fp8 values need a feature size divisible by 4 to move as int32, got {flat.shape[1]}")
        return flat.view(torch.uint8).view(_FP8_CARRIER), 4
    return flat, 1


def _from_carrier(flat: torch.Tensor, dtype: torch.dtype, feature_shape: tuple) -> torch.Tensor:
    if dtype in FP8_DTYPES:
        flat = flat.contiguous().view(torch.uint8).view(dtype)
    return flat.reshape(*flat.shape[:-1], *feature_shape)


class JaggedTensor:
    """A batch of ``B`` sequences of different lengths, stored without padding.

    ``values``: ``[total, *features]`` (contiguous); ``offsets``: int32/int64 ``[B + 1]``, sequence
    ``b`` is ``values[offsets[b]:offsets[b + 1]]`` (fbgemm's offsets, FlashAttention's cu_seqlens).
    """

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor):
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dim() < 1:
            raise ValueError("values must have a leading token dimension")
        validate_offsets(offsets, values.shape[0], "offsets")
        if offsets.device != values.device:
            raise ValueError(f"offsets is on {offsets.device} but values is on {values.device}")
        self.values = values.contiguous()
        self.offsets = offsets

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths) -> "JaggedTensor":
        return cls(values, offsets_from_lengths(checked_lengths(lengths, values.device)))

    @property
    def lengths(self) -> torch.Tensor:
        return lengths_of(self.offsets)

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def max_length(self) -> int:
        return max_length(self.offsets, self.values.shape[0])

    @property
    def feature_shape(self) -> tuple:
        return tuple(self.values.shape[1:])

    def __repr__(self) -> str:
        return (f"JaggedTensor(batch_size={self.batch_size}, total={self.values.shape[0]}, "
                f"features={self.feature_shape}, dtype={self.values.dtype}, device={self.values.device})")

    def to_padded(self, padding_value: float = 0.0, max_length: int | None = None, *, use_fbgemm=False):
        """Dense ``[B, max_length, *features]``; sequences longer than ``max_length`` are truncated.

        ``use_fbgemm=True`` goes through ``torch.ops.fbgemm.jagged_to_padded_dense`` (needs fbgemm-gpu).
        fp8 values move bit-exactly (as int32 words) and accept only ``padding_value=0``.
        """
        max_length = self.max_length if max_length is None else int(max_length)
        if self.values.dtype in FP8_DTYPES and padding_value != 0:
            raise ValueError("padding_value must be 0 for fp8 values")
        flat, _ = _carrier_view(self.values)
        op = _fbgemm_op("jagged_to_padded_dense") if use_fbgemm else torch.ops.aten._jagged_to_padded_dense_forward
        dense = op(flat, [bounded_offsets(self.offsets, flat.shape[0])], [max_length], padding_value)
        return _from_carrier(dense, self.values.dtype, self.feature_shape)

    @classmethod
    def from_padded(cls, dense: torch.Tensor, lengths, *, use_fbgemm=False) -> "JaggedTensor":
        """Inverse of :meth:`to_padded`: keep the first ``lengths[b]`` rows of ``dense[b]``."""
        if not isinstance(dense, torch.Tensor) or dense.dim() < 2:
            raise ValueError("dense must be a tensor [B, max_length, *features]")
        lengths = checked_lengths(lengths, dense.device)
        if lengths.shape != (dense.shape[0],):
            raise ValueError(f"lengths must have shape ({dense.shape[0]},), got {tuple(lengths.shape)}")
        if bool((lengths > dense.shape[1]).any()):
            raise ValueError(f"lengths must lie in [0, {dense.shape[1]}]")
        offsets = offsets_from_lengths(lengths)
        feature_shape = tuple(dense.shape[2:])
        flat, _ = _carrier_view(dense.reshape(dense.shape[0] * dense.shape[1], *feature_shape))
        flat = flat.reshape(dense.shape[0], dense.shape[1], -1)
        total = int(offsets[-1])
        if use_fbgemm:
            values = _fbgemm_op("dense_to_jagged")(flat, [offsets], total)[0]
        else:
            values = torch.ops.aten._padded_dense_to_jagged_forward(flat, [offsets], total)
        return cls(_from_carrier(values, dense.dtype, feature_shape), offsets)

    def to_nested(self) -> torch.Tensor:
        """A torch jagged-layout nested tensor sharing ``values`` (``[B, j, *features]``)."""
        return torch.nested.nested_tensor_from_jagged(self.values, self.offsets.to(torch.int64))

    @classmethod
    def from_nested(cls, njt: torch.Tensor) -> "JaggedTensor":
        """From a jagged-layout nested tensor ``[B, j, *features]`` (``layout=torch.jagged``)."""
        if not is_jagged_nested(njt):
            raise TypeError("njt must be a nested tensor with layout=torch.jagged")
        if njt._ragged_idx != 1 or njt.lengths() is not None:
            raise ValueError("njt must be ragged in dim 1 and contiguous (no holes)")
        return cls(njt.values(), njt.offsets())


def is_jagged_nested(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_nested and x.layout == torch.jagged


def unpack_attention_nested(njt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A jagged nested tensor in either attention layout -> (values ``[total, H, D]``, offsets, heads_first).

    ``[B, j, H, D]`` (ragged dim 1) or SDPA's ``[B, H, j, D]`` (ragged dim 2, ``heads_first``).
    """
    heads_first = njt.dim() == 4 and njt._ragged_idx == 2
    jt = JaggedTensor.from_nested(njt.transpose(1, 2) if heads_first else njt)
    return jt.values, jt.offsets, heads_first


def pack_attention_nested(values: torch.Tensor, offsets: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """Inverse of :func:`unpack_attention_nested`."""
    njt = torch.nested.nested_tensor_from_jagged(values, offsets.to(torch.int64))
    return njt.transpose(1, 2) if heads_first else njt


JAGGED_KINDS = ("a torch.Tensor (with offsets)", "a JaggedTensor", "a jagged nested tensor",
                "fbgemm's (values, [offsets]) pair",
                "an object with .values() and .offsets() methods (torchrec's JaggedTensor)")


def _has_methods(x, *names) -> bool:
    return all(callable(getattr(x, name, None)) for name in names)


def unpack_jagged(x, offsets, name: str, other_kinds: tuple[str, ...] = ()):
    """A ragged batch in any of :data:`JAGGED_KINDS` -> (values ``[total, ...]``, offsets, pack).

    ``pack(values, offsets)`` puts a result back into the kind of container ``x`` came in: a tensor,
    a JaggedTensor, a nested tensor of the same layout, a ``(values, [offsets])`` pair, or
    ``type(x)(values=..., offsets=...)`` (torchrec's constructor). ``offsets`` given explicitly replace
    the container's (a nested tensor carries its own: ValueError). Anything else is a TypeError listing
    the accepted kinds (and ``other_kinds``, which the caller handles itself)."""
    if is_jagged_nested(x):
        if offsets is not None:
            raise ValueError(f"{name} is a nested tensor: it carries its own offsets, do not pass them")
        values, offsets, heads_first = unpack_attention_nested(x)
        return values, offsets, lambda out, out_offsets: pack_attention_nested(out, out_offsets, heads_first)
    if isinstance(x, torch.Tensor):
        return x, offsets, lambda out, out_offsets: out
    if isinstance(x, JaggedTensor):
        return x.values, x.offsets if offsets is None else offsets, JaggedTensor
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], (list, tuple)):
        if len(x[1]) != 1:
            raise ValueError(f"{name}: fbgemm-style (values, [offsets]) must hold exactly one offsets tensor")
        return x[0], x[1][0] if offsets is None else offsets, lambda out, out_offsets: (out, [out_offsets])
    if _has_methods(x, "values", "offsets"):
        if _has_methods(x, "keys"):
            raise TypeError(f"{name} is a {type(x).__name__} with keys (torchrec's KeyedJaggedTensor): its offsets "
                            f"run over every key; pass one key's JaggedTensor, {name}[key], per call")
        return x.values(), x.offsets() if offsets is None else offsets, _rebuild(type(x), name)
    kinds = (*JAGGED_KINDS, *other_kinds)
    raise TypeError(f"{name} must be {', '.join(kinds[:-1])} or {kinds[-1]}; got {type(x).__name__}")


def _rebuild(kind: type, name: str):
    def pack(values: torch.Tensor, offsets: torch.Tensor):
        try:
            return kind(values=values, offsets=offsets)
        except TypeError as e:
            raise TypeError(f"{name}'s type {kind.__name__} has .values() and .offsets() but no "
                            f"{kind.__name__}(values=..., offsets=...) to build the result with") from e

    return pack


def split_heads(values: torch.Tensor, heads, name: str) -> torch.Tensor:
    """fbgemm's / torchrec's 2-D ``[total, heads * D]`` values as ``[total, heads, D]`` (a view)."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[1] % heads:
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"{name}: heads={heads} splits 2-D [total, heads * D] values, got {shape}")
    return values.unflatten(1, (heads, values.shape[1] // heads))


def _fbgemm_op(name: str):
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError as e:
        raise ImportError(
            "fbgemm-gpu is not installed: pip install fbgemm-gpu-cpu==<version matching torch>"
        ) from e
    return getattr(torch.ops.fbgemm, name)
