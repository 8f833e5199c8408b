"""KV buffers: `KVPool` (per-layer K/V tensors indexed by slot id) and `SWAKVPool` (a full pool
plus an SWA pool behind one global layer numbering).

Rows are slot ids of the matching allocator: `size + page_size` rows, the first page being padding.
K and V may differ in head dim (MiMo-V2-Flash: K 192, V 128); full and SWA layers may differ in
KV heads and dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the KV of one layer kind."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def token_bytes(self, dtype: torch.dtype) -> int:
        """F or S of architecture §2: one token, one layer."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * _dtype_bytes(dtype)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """K/V buffers of `len(layouts)` layers, each `[size + page_size, heads, dim]`.

    Layers may differ in layout: with `disable_hybrid_swa_memory` one pool serves full and SWA
    layers alike, every layer indexed by the same slot ids.
    """

    def __init__(
        self,
        size: int,
        layouts: list[KVLayout],
        *,
        dtype: torch.dtype = torch.float32,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        layer_ids: list[int] | None = None,
        scratch_rows: int = 0,
        scratch_layer_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`layer_ids`: the global id of each layout's layer (default 0, 1, ...): a model whose
        KV-shared layers own no KV leaves their ids out. `scratch_rows`: rows past the slots
        (ids from `scratch_base` on) that no allocator hands out, in the buffers of the layers
        `scratch_layer_ids` only: where MTP draft steps write the KV of positions that hold no
        slot yet (`engine.mtp`)."""
        if size < 0 or page_size <= 0 or scratch_rows < 0:
            raise ValueError(
                f"bad KV pool shape: size={size}, page_size={page_size}, scratch={scratch_rows}"
            )
        self.layer_ids = list(range(len(layouts))) if layer_ids is None else list(layer_ids)
        if len(self.layer_ids) != len(layouts):
            raise ValueError(f"{len(self.layer_ids)} layer ids for {len(layouts)} layouts")
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}
        self.size = size
        self.num_layers = len(layouts)
        self.layouts = list(layouts)
        self.dtype = dtype
        self.page_size = page_size
        self.device = torch.device(device)
        self.scratch_base = size + page_size
        rows = [
            size + page_size + (scratch_rows if layer in scratch_layer_ids else 0)
            for layer in self.layer_ids
        ]
        self.k_buffer = [
            torch.zeros(
                n, lay.num_kv_heads, lay.head_dim, dtype=dtype, device=self.device
            )  # [rows, Hkv, Dk]
            for n, lay in zip(rows, self.layouts, strict=True)
        ]
        self.v_buffer = [
            torch.zeros(
                n, lay.num_kv_heads, lay.v_head_dim, dtype=dtype, device=self.device
            )  # [rows, Hkv, Dv]
            for n, lay in zip(rows, self.layouts, strict=True)
        ]

    def token_bytes(self) -> int:
        """Bytes of one token across all layers of this pool."""
        return sum(lay.token_bytes(self.dtype) for lay in self.layouts)

    def kv_bytes(self) -> int:
        return self.token_bytes() * (self.size + self.page_size)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[self._index[layer]]

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index[layer]
        return self.k_buffer[i], self.v_buffer[i]

    def set_kv_buffer(
        self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K/V of `len(loc)` tokens (`[n, heads, dim]`) at slot ids `loc` of `layer`."""
        if k.shape[0] != loc.shape[0] or v.shape[0] != loc.shape[0]:
            raise ValueError(
                f"set_kv_buffer: {loc.shape[0]} locations but k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        i = self._index[layer]
        self.k_buffer[i][loc] = k.to(self.dtype)
        self.v_buffer[i][loc] = v.to(self.dtype)


@dataclass(frozen=True, slots=True)
class LayerSlot:
    """Where a global layer's KV lives: its index inside the full or the SWA pool."""

    local_id: int
    is_swa: bool


class SWAKVPool:
    """A full pool and an SWA pool behind one global layer numbering.

    `layers_mapping[global_layer] = LayerSlot(local_id, is_swa)`. Writes and reads of SWA layers
    take SWA slot ids that the caller translated once per batch (`SWATokenAllocator.translate`);
    this class never translates per layer.
    """

    def __init__(
        self,
        *,
        full_size: int,
        swa_size: int,
        full_layer_ids: list[int],
        swa_layer_ids: list[int],
        full_layout: KVLayout,
        swa_layout: KVLayout,
        dtype: torch.dtype = torch.float32,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        scratch_rows: int = 0,
        scratch_layer_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`scratch_rows`: in the SWA pool's buffers of the (global) `scratch_layer_ids` (see
        `KVPool`)."""
        overlap = set(full_layer_ids) & set(swa_layer_ids)
        if overlap:
            raise ValueError(f"layer(s) {sorted(overlap)} are listed as both full and SWA")
        all_ids = sorted([*full_layer_ids, *swa_layer_ids])
        if all_ids != list(range(len(all_ids))):
            raise ValueError(f"layer ids must be 0..{len(all_ids) - 1} exactly once, got {all_ids}")
        self.page_size = page_size
        self.full_pool = KVPool(
            full_size,
            [full_layout] * len(full_layer_ids),
            dtype=dtype,
            page_size=page_size,
            device=device,
        )
        self.swa_pool = KVPool(
            swa_size,
            [swa_layout] * len(swa_layer_ids),
            dtype=dtype,
            page_size=page_size,
            device=device,
            scratch_rows=scratch_rows,
            scratch_layer_ids=frozenset(
                local
                for local, layer in enumerate(sorted(swa_layer_ids))
                if layer in scratch_layer_ids
            ),
        )
        self.layers_mapping: dict[int, LayerSlot] = {}
        for local, layer in enumerate(sorted(full_layer_ids)):
            self.layers_mapping[layer] = LayerSlot(local, False)
        for local, layer in enumerate(sorted(swa_layer_ids)):
            self.layers_mapping[layer] = LayerSlot(local, True)

    @property
    def num_layers(self) -> int:
        return len(self.layers_mapping)

    def is_swa_layer(self, layer: int) -> bool:
        return self._slot(layer).is_swa

    def kv_bytes(self) -> int:
        return self.full_pool.kv_bytes() + self.swa_pool.kv_bytes()

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V buffers of a global layer; index them with full slot ids for full layers and
        translated SWA slot ids for SWA layers."""
        slot = self._slot(layer)
        pool = self.swa_pool if slot.is_swa else self.full_pool
        return pool.get_kv_buffer(slot.local_id)

    def set_kv_buffer(
        self,
        layer: int,
        full_loc: torch.Tensor,
        swa_loc: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write K/V for a global layer: full layers at `full_loc`, SWA layers at `swa_loc`
        (translated once per batch)."""
        slot = self._slot(layer)
        if slot.is_swa:
            if swa_loc is None:
                raise ValueError(f"layer {layer} is an SWA layer: pass the translated swa_loc")
            self.swa_pool.set_kv_buffer(slot.local_id, swa_loc, k, v)
        else:
            self.full_pool.set_kv_buffer(slot.local_id, full_loc, k, v)

    def _slot(self, layer: int) -> LayerSlot:
        try:
            return self.layers_mapping[layer]
        except KeyError:
            raise ValueError(
                f"no layer {layer}; the pool has layers 0..{self.num_layers - 1}"
            ) from None
