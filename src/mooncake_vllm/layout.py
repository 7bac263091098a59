"""Where one KV block lives in memory, for every KV-cache layout vLLM hands over.

A block's stored bytes are, for each layer in order, that layer's slice(s) for
the block, copied whole and treated as opaque (the CPU backend packs K for its
attention ISA; GPU backends keep ``[block_size, heads, head_size]`` pages).

Kinds (per-layer tensor shape → segments per block):

* ``cpu``   ``[num_blocks, kv_heads, block_size, 2*head]`` → ``kv[b]``
* ``nhd``   ``[2, num_blocks, block_size, kv_heads, head]`` (FlashAttention, V0 and
  V1 GPU) → ``kv[0, b]``, ``kv[1, b]``
* ``cpu-hnd`` ``[2, num_blocks, kv_heads, block_size, head]`` (vLLM's CPU backend up to
  0.23) → ``kv[0, b]``, ``kv[1, b]``: handled as ``nhd`` stored heads first (bytes ``hnd``;
  the CPU kernels pack K their own way, so the prediction tags it with a ``cpu`` variant)
* ``cpu-paged`` ``[2, num_blocks, block_size*kv_heads*head]`` (vLLM's V1 CPU backend up to
  0.11.0: PagedAttention or IPEX pages, whose inner order the variant names) →
  ``kv[0, b]``, ``kv[1, b]``: handled as ``nhd`` ``[2, B, 1, 1, C]``, bytes ``paged``
* ``nhd-interleaved`` ``[num_blocks, 2, block_size, kv_heads, head]`` (FlashInfer) →
  ``kv[b]``; byte-identical per block to ``nhd``, so both share one fingerprint
* ``mla``   ``[num_blocks, block_size, head]`` → ``kv[b]``
* ``hnc``   ``[num_blocks, heads, block_size, C]`` (vLLM's generic ``[B, H, N, C]``
  per-layer views of one backing buffer, releases with a resolved
  ``KVCacheLayout``; C holds K then V of one head and token, or MLA's latent with
  ``heads == 1``) → ``kv[b]``

The two 5-dim GPU kinds may come with the HND stride order vLLM's backends use
(``get_kv_cache_stride_order``): the logical shape stays ``[.., block_size,
kv_heads, head]`` while memory runs ``heads, block_size, head``. Their bytes are
then named ``hnd``: a block's stored bytes are always its bytes in memory.
Likewise the 4-dim ``hnc`` kind is named ``hnc`` when memory runs heads first
(``LBHNC``/``BLHNC``) and ``nhc`` when it runs tokens first (``LBNHC``/``BLNHC``).
Block-outermost layouts (``BL..``: one buffer, each block holding every layer's
page) give per-layer views whose blocks are still contiguous, so their bytes and
fingerprints equal the layer-outermost ones. Layouts that split one layer's page
(``BHLNC``, ``LHBNC``) are refused with a clear error.

The fingerprint names the bytes, not the backend: blocks are interchangeable
exactly when fingerprints match. Tensors may live in host or CUDA memory
(:attr:`BlockLayout.on_cuda`); :meth:`BlockLayout.byte_views` gives the torch
views a device path gathers blocks through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "BlockLayout", "TensorView", "bytes_kind", "layout_fingerprint"]

KINDS = ("cpu", "cpu-hnd", "cpu-paged", "nhd", "nhd-interleaved", "mla", "hnc")
_BYTES_KIND = {"cpu": "cpu", "cpu-hnd": "hnd", "cpu-paged": "paged", "nhd": "nhd", "nhd-interleaved": "nhd",
               "mla": "mla", "hnd": "hnd", "hnc": "hnc", "nhc": "nhc"}
#: 5-dim kinds whose inner ``[block_size, heads, head]`` may be stored heads-first
_FIVE_DIM = ("nhd", "nhd-interleaved")


@dataclass(frozen=True)
class TensorView:
    """The facts about one KV tensor we need: address, shape, strides, dtype."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int
    dtype: str
    device: str = "cpu"  # torch's device string: "cpu", "cuda:0", ...

    @classmethod
    def of(cls, tensor: Any) -> TensorView:
        """From a ``torch.Tensor`` or a ``numpy.ndarray``."""
        if hasattr(tensor, "data_ptr"):  # torch
            return cls(tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
                       tensor.element_size(), str(tensor.dtype).removeprefix("torch."),
                       str(tensor.device))
        if hasattr(tensor, "__array_interface__"):  # numpy
            item = tensor.dtype.itemsize
            return cls(tensor.ctypes.data, tuple(tensor.shape),
                       tuple(s // item for s in tensor.strides), item, tensor.dtype.name)
        raise TypeError(f"KV cache entries must be torch tensors or numpy arrays, "
                        f"found {type(tensor).__name__}")

    def contiguous_from(self, dim: int) -> bool:
        """Whether dims ``dim..`` are laid out densely (C order)."""
        expected = 1
        for size, stride in zip(reversed(self.shape[dim:]), reversed(self.strides[dim:])):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def heads_first(self) -> bool:
        """5-dim ``[.., block_size, heads, head]`` stored heads-first (HND stride order)."""
        return (len(self.shape) == 5 and self.shape[2] > 1 and self.shape[3] > 1
                and self.strides[3] > self.strides[2])

    def tokens_first(self) -> bool:
        """4-dim ``[B, heads, block_size, C]`` stored tokens-first (``LBNHC``/``BLNHC``)."""
        return (len(self.shape) == 4 and self.shape[1] > 1 and self.shape[2] > 1
                and self.strides[2] > self.strides[1])

    def physical(self) -> TensorView:
        """The same memory with ``block_size`` and ``heads`` swapped where stored so."""
        if self.heads_first():
            order: tuple[int, ...] = (0, 1, 3, 2, 4)
        elif self.tokens_first():
            order = (0, 2, 1, 3)
        else:
            return self
        return TensorView(self.ptr, tuple(self.shape[i] for i in order),
                          tuple(self.strides[i] for i in order), self.itemsize, self.dtype,
                          self.device)

    def extent(self) -> tuple[int, int]:
        """``(start, end)`` byte addresses the tensor touches."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if n > 0)
        return self.ptr, self.ptr + (last + 1) * self.itemsize


def _guess_kind(shape: tuple[int, ...]) -> str:
    if len(shape) == 4:
        return "cpu"
    if len(shape) == 3:
        return "mla"
    if len(shape) == 5:
        if shape[0] == 2 and shape[1] != 2:
            return "nhd"
        if shape[1] == 2 and shape[0] != 2:
            return "nhd-interleaved"
    raise ValueError(
        f"cannot tell the KV layout of a tensor of shape {list(shape)}; "
        f"pass kind= one of {', '.join(KINDS)}")


def _as_heads_first_nhd(views: Sequence[TensorView], tensors: Sequence[Any]
                        ) -> tuple[list[TensorView], list[Any], str]:
    """``cpu-hnd`` ``[2, B, H, N, D]`` tensors as ``nhd`` ``[2, B, N, H, D]`` views (no copy)."""
    if any(len(v.shape) != 5 or v.shape[0] != 2 for v in views):
        raise ValueError(f"a cpu-hnd KV tensor is [2, num_blocks, kv_heads, block_size, head]; "
                         f"found shape {list(views[0].shape)}")
    order = (0, 1, 3, 2, 4)
    swapped = [TensorView(v.ptr, tuple(v.shape[i] for i in order),
                          tuple(v.strides[i] for i in order), v.itemsize, v.dtype, v.device)
               for v in views]
    return swapped, [t.swapaxes(2, 3) for t in tensors], "nhd"


def _as_flat_nhd(views: Sequence[TensorView], tensors: Sequence[Any]
                 ) -> tuple[list[TensorView], list[Any], str]:
    """``cpu-paged`` ``[2, B, C]`` tensors as ``nhd`` ``[2, B, 1, 1, C]`` views (no copy)."""
    if any(len(v.shape) != 3 or v.shape[0] != 2 for v in views):
        raise ValueError(f"a cpu-paged KV tensor is [2, num_blocks, block_size*kv_heads*head]; "
                         f"found shape {list(views[0].shape)}")
    flat = [TensorView(v.ptr, (2, v.shape[1], 1, 1, v.shape[2]),
                       (v.strides[0], v.strides[1], v.shape[2] * v.strides[2],
                        v.shape[2] * v.strides[2], v.strides[2]), v.itemsize, v.dtype, v.device)
            for v in views]
    # torch: view() (never a silent copy); numpy: reshape of these C-contiguous pages
    return flat, [(t.view if hasattr(t, "data_ptr") else t.reshape)(2, t.shape[1], 1, 1, t.shape[2])
                  for t in tensors], "nhd"


def bytes_kind(kind: str, heads_first: bool) -> str:
    """The fingerprint kind of tensor kind ``kind`` stored (or not) heads before tokens."""
    if kind in _FIVE_DIM:
        return "hnd" if heads_first else "nhd"
    if kind == "hnc":
        return "hnc" if heads_first else "nhc"
    return kind


def layout_fingerprint(kind: str, dtype: str, num_layers: int,
                       block_shape: Sequence[int], variant: str = "") -> str:
    """Name the bytes of one stored block; equal fingerprints ⇔ interchangeable blocks."""
    if kind not in _BYTES_KIND:
        raise ValueError(f"unknown KV layout kind {kind!r}; expected one of {', '.join(KINDS)}")
    shape = "x".join(str(n) for n in block_shape)
    tag = f":{variant}" if variant else ""
    return f"{_BYTES_KIND[kind]}{tag}:{dtype}:L{num_layers}:{shape}"


class BlockLayout:
    """Block-granular view over a model's per-layer KV-cache tensors."""

    def __init__(self, views: Sequence[TensorView], kind: str, variant: str = "",
                 tensors: Sequence[Any] = ()) -> None:
        if not views:
            raise ValueError("no KV cache tensors given")
        #: fingerprint (kind, block shape) where it is not the handled kind's own
        named: tuple[str, tuple[int, ...]] | None = None
        if kind == "cpu-hnd":  # the same memory seen as [2, B, N, H, D] stored heads first
            views, tensors, kind = _as_heads_first_nhd(views, tensors)
        elif kind == "cpu-paged":  # one page per block for K and one for V: [2, B, 1, 1, C]
            named = ("cpu-paged", (2, views[0].shape[-1]))
            views, tensors, kind = _as_flat_nhd(views, tensors)
        first = views[0]
        for v in views[1:]:
            if (v.shape, v.strides, v.dtype, v.device) != (first.shape, first.strides,
                                                           first.dtype, first.device):
                raise ValueError("all layers' KV tensors must share shape, strides, dtype and "
                                 f"device; found {list(first.shape)} and {list(v.shape)}")
        self.kind = kind
        self.views = list(views)
        #: the tensors themselves (torch or numpy), for device paths; may be empty
        self.tensors = list(tensors)
        self.dtype = first.dtype
        self.device = first.device
        self.num_layers = len(views)
        if kind == "hnc":
            if len(first.shape) != 4:
                raise ValueError(f"a {kind} KV tensor is [num_blocks, heads, block_size, C]; "
                                 f"found shape {list(first.shape)}")
            self.heads_first = not first.tokens_first()
        else:
            self.heads_first = kind in _FIVE_DIM and first.heads_first()
        shape = first.shape
        if kind == "nhd":
            self.num_blocks, self.block_size = shape[1], shape[2]
            seg_dims, block_shape = 2, (2, *shape[2:])
        else:
            self.num_blocks = shape[0]
            self.block_size = shape[2] if kind in ("cpu", "nhd-interleaved", "hnc") else shape[1]
            seg_dims, block_shape = 1, shape[1:]
        physical = first.physical() if kind in (*_FIVE_DIM, "hnc") else first
        if not physical.contiguous_from(seg_dims):
            hint = ""
            if kind == "hnc":
                hint = ("; this vLLM KV cache layout splits one layer's page of a block "
                        "(BHLNC or LHBNC). Fix: set VLLM_KV_CACHE_LAYOUT to LBNHC, LBHNC, "
                        "BLNHC or BLHNC")
            raise ValueError(f"each block of a {kind} KV tensor must be contiguous; "
                             f"strides {list(first.strides)} for shape {list(shape)}{hint}")
        self.block_shape = tuple(block_shape)
        count = 1
        for n in shape[seg_dims:]:
            count *= n
        #: bytes of one segment, and segments per layer of one block (K and V apart for ``nhd``)
        self.seg_nbytes = count * first.itemsize
        self.segs_per_layer = 2 if kind == "nhd" else 1
        self.block_nbytes = self.seg_nbytes * self.segs_per_layer * self.num_layers
        fp_kind, fp_shape = named or (bytes_kind(kind, self.heads_first), self.block_shape)
        self.fingerprint = layout_fingerprint(fp_kind, self.dtype, self.num_layers, fp_shape, variant)

    @property
    def on_cuda(self) -> bool:
        """Whether the KV cache lives in CUDA memory (never read it from the host)."""
        return self.device.startswith("cuda")

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, Any] | Sequence[Any],
                       kind: str = "auto", variant: str = "") -> BlockLayout:
        """Build from vLLM's per-layer KV caches (a ``{layer: tensor}`` dict or a list)."""
        tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
        views = [TensorView.of(t) for t in tensors]
        if not views:
            raise ValueError("no KV cache tensors given")
        if kind == "auto":
            kind = _guess_kind(views[0].shape)
        elif kind in _FIVE_DIM:
            # FlashAttention and FlashInfer tensors hold the same bytes per block (one
            # fingerprint): the tensor's own shape tells which of the two it is
            try:
                guessed = _guess_kind(views[0].shape)
            except ValueError:
                guessed = kind
            if guessed in _FIVE_DIM:
                kind = guessed
        if kind not in KINDS:
            raise ValueError(f"unknown KV layout kind {kind!r}; expected one of {', '.join(KINDS)}")
        return cls(views, kind, variant, tensors)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the cache's {self.num_blocks} blocks")

    def segments(self, block_id: int) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every piece of block ``block_id``, all layers in order."""
        self._check(block_id)
        out: list[tuple[int, int]] = []
        for v in self.views:
            if self.kind == "nhd":
                for half in (0, 1):
                    off = (half * v.strides[0] + block_id * v.strides[1]) * v.itemsize
                    out.append((v.ptr + off, self.seg_nbytes))
            else:
                out.append((v.ptr + block_id * v.strides[0] * v.itemsize, self.seg_nbytes))
        return out

    def byte_views(self) -> list[Any]:
        """Per layer, a torch ``uint8`` view ``[segs_per_layer, num_blocks, seg_nbytes]``.

        Row ``[s, b]`` holds exactly the bytes of :meth:`segments` ``(b)``'s segment
        ``s`` of that layer, so gathering rows layer by layer yields a block's stored
        bytes. Works for host and CUDA tensors alike (no host read of device memory).
        """
        import torch

        out = []
        for tensor in self.tensors:
            t = torch.as_tensor(tensor)
            if self.kind == "hnc" and not self.heads_first and t.dim() == 4 \
                    and t.shape[1] > 1 and t.shape[2] > 1:
                t = t.permute(0, 2, 1, 3)
            elif self.heads_first and self.kind in _FIVE_DIM:
                t = t.permute(0, 1, 3, 2, 4)
            # view(), never reshape(): a silent copy would make loads write nowhere
            if self.kind == "nhd":
                rows = t.view(t.shape[0], t.shape[1], -1)
            else:
                rows = t.view(t.shape[0], -1).unsqueeze(0)
            out.append(rows.view(torch.uint8))
        if len(out) != self.num_layers:
            raise ValueError("this layout was built without its tensors; use from_kv_caches")
        return out

    def regions(self) -> list[tuple[int, int]]:
        """Distinct ``(ptr, nbytes)`` memory regions covering every layer (merged)."""
        spans = sorted(v.extent() for v in self.views)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(s, e - s) for s, e in merged]
