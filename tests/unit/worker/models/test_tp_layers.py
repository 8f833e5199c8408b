"""Tensor-parallel layers and sharded loading, in one process: a model built for rank r of a
TP group of 2 (no collectives run while loading) holds exactly its slice of every parameter, in
every checkpoint layout; sharded experts add up to the full experts on both batched paths;
configs that do not split raise `ShardingError`. Real 2-process forwards are in
tests/integration/worker/test_tp_model.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ref_backend import RefBackend
from safetensors.torch import save_file

from swaserve.worker.models.checkpoint import SINGLE_FILE, Checkpoint
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.loader import build_model, load_model
from swaserve.worker.models.param_shard import ParamShard
from swaserve.worker.models.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    even_segments,
)
from swaserve.worker.models.weight_sources import PlainSource
from swaserve.worker.runner.parallel import ShardingError, TPGroup


def rank(r: int, world_size: int = 2) -> TPGroup:
    """Rank r's view of a group, without process groups: enough to build and load a shard."""
    return TPGroup(rank=r, world_size=world_size)


def test_pieces_of_an_original_layout_expert_part() -> None:
    # MiMo gate_up_proj [E=4, 2I=64, D=32] on rank 1 of 2: gate rows [8, 16), up rows [40, 48).
    shard = ParamShard((4, 64, 32), 1, ((8, 16), (40, 48)), 16)
    # The checkpoint's expert 2 up_proj fills full[2, 32:64]: its rows [8, 16) → local [8, 16).
    assert shard.pieces((2, slice(32, 64))) == [
        ((2, slice(8, 16), slice(0, 32)), (slice(8, 16), slice(0, 32)))
    ]
    assert shard.pieces((2, slice(0, 32))) == [
        ((2, slice(0, 8), slice(0, 32)), (slice(8, 16), slice(0, 32)))
    ]
    assert shard.pieces(()) == [
        ((slice(0, 4), slice(0, 8), slice(0, 32)), (slice(0, 4), slice(8, 16), slice(0, 32))),
        ((slice(0, 4), slice(8, 16), slice(0, 32)), (slice(0, 4), slice(40, 48), slice(0, 32))),
    ]


def test_column_and_row_linear_load_their_slices_exactly(tmp_path: Path) -> None:
    weight = torch.arange(24, dtype=torch.float32).view(6, 4)  # [6, 4]
    bias = torch.arange(6, dtype=torch.float32) * 10  # [6]
    row_weight = torch.arange(24, dtype=torch.float32).view(4, 6)  # [4, 6]
    save_file({"w": weight, "b": bias, "rw": row_weight}, str(tmp_path / SINGLE_FILE))
    x = torch.linspace(-1, 1, 12).view(2, 6)  # [2, 6]
    partial_rows = []
    with Checkpoint(tmp_path) as checkpoint:
        for r in range(2):
            col = ColumnParallelLinear(
                4, 6, even_segments(6, rank(r), "out"), bias=True, dtype=torch.float32
            )
            row = RowParallelLinear(
                6, 4, even_segments(6, rank(r), "in"), bias=False, dtype=torch.float32, tp=rank(r)
            )
            for module, names in ((col, {"weight": "w", "bias": "b"}), (row, {"weight": "rw"})):
                for key, stored in names.items():
                    source = PlainSource(checkpoint.tensors[stored])
                    for index, region in module.param_shards[key].pieces(()):
                        source.read_into(getattr(module, key).data[index], checkpoint, region)
            assert torch.equal(col.weight, weight[3 * r : 3 * r + 3])
            assert torch.equal(col.bias, bias[3 * r : 3 * r + 3])
            assert torch.equal(row.weight, row_weight[:, 3 * r : 3 * r + 3])
            partial_rows.append(F.linear(x[:, 3 * r : 3 * r + 3], row.weight))
    assert torch.allclose(sum(partial_rows), F.linear(x, row_weight), atol=1e-6)


def _full_and_ranks(
    model_dir: Path,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    full = load_model(model_dir, RefBackend()).state_dict()
    ranks = [load_model(model_dir, RefBackend(), tp=rank(r)).state_dict() for r in range(2)]
    return full, ranks


LAYOUTS = {
    "gpt-oss": dict(arch="gpt-oss", vocab_size=287),
    "gpt-oss-mxfp4-kv1": dict(arch="gpt-oss", quantization="mxfp4", num_kv_heads=1),
    "gpt-oss-original": dict(arch="gpt-oss", checkpoint_format="original"),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_gpt_oss_shards_are_the_full_model_sliced(
    name: str, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory(**LAYOUTS[name])
    config = load_model_config(model_dir)
    full, ranks = _full_and_ranks(model_dir)
    hkv, dk = config.full_attention.num_kv_heads, config.full_attention.head_dim
    i_r = config.moe.intermediate_size // 2  # 16 per rank
    v = config.vocab_size
    for r, local in enumerate(ranks):
        attn, experts = "model.layers.1.self_attn.", "model.layers.1.mlp.experts."
        assert torch.equal(
            local[attn + "q_proj.weight"], full[attn + "q_proj.weight"][16 * r :][:16]
        )
        assert torch.equal(local[attn + "q_proj.bias"], full[attn + "q_proj.bias"][16 * r :][:16])
        kv = r if hkv == 2 else 0  # one KV head each, or both ranks a replica of the only one
        assert torch.equal(
            local[attn + "k_proj.weight"], full[attn + "k_proj.weight"][kv * dk :][:dk]
        )
        assert torch.equal(local[attn + "v_proj.bias"], full[attn + "v_proj.bias"][kv * dk :][:dk])
        assert torch.equal(local[attn + "sinks"], full[attn + "sinks"][2 * r : 2 * r + 2])
        o_cols = full[attn + "o_proj.weight"][:, 16 * r : 16 * r + 16]
        assert torch.equal(local[attn + "o_proj.weight"], o_cols)
        assert torch.equal(local[attn + "o_proj.bias"], full[attn + "o_proj.bias"])
        # Interleaved gate/up: rank r's gate AND up columns of intermediate units [16r, 16r + 16).
        gate_up, gate_up_bias = full[experts + "gate_up_proj"], full[experts + "gate_up_proj_bias"]
        units = slice(i_r * r, i_r * (r + 1))
        assert torch.equal(local[experts + "gate_up_proj"][..., ::2], gate_up[..., ::2][..., units])
        assert torch.equal(
            local[experts + "gate_up_proj"][..., 1::2], gate_up[..., 1::2][..., units]
        )
        assert torch.equal(
            local[experts + "gate_up_proj_bias"][:, 1::2], gate_up_bias[:, 1::2][:, units]
        )
        assert torch.equal(local[experts + "down_proj"], full[experts + "down_proj"][:, units])
        assert torch.equal(local[experts + "down_proj_bias"], full[experts + "down_proj_bias"])
        assert torch.equal(
            local["model.layers.1.mlp.router.weight"], full["model.layers.1.mlp.router.weight"]
        )
        rows = -(-v // 2)
        embed = local["model.embed_tokens.weight"]
        assert embed.shape[0] == rows
        held = min(rows, v - rows * r)
        assert torch.equal(embed[:held], full["model.embed_tokens.weight"][rows * r :][:held])
        assert torch.equal(embed[held:], torch.zeros(rows - held, config.hidden_size))
        assert torch.equal(
            local["lm_head.weight"][:held], full["lm_head.weight"][rows * r :][:held]
        )
    assert (rows, v) == ((144, 287) if name == "gpt-oss" else (144, 288))


@pytest.mark.parametrize(
    "options",
    [
        dict(num_kv_heads=1),
        dict(checkpoint_format="original"),
        dict(quantization="fp8", fp8_block_size=(16, 16)),
    ],
    ids=["kv1x2", "original", "fp8"],
)
def test_mimo_shards_are_the_full_model_sliced(
    options: dict[str, object], tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory(arch="mimo-v2-flash", num_layers=3, **options)
    config = load_model_config(model_dir)
    full, ranks = _full_and_ranks(model_dir)
    i_all, i_r = config.moe.intermediate_size, config.moe.intermediate_size // 2
    dense_r = config.intermediate_size // 2
    full_kv = config.full_attention.num_kv_heads  # layer 0; layers 1, 2 are SWA with twice as many
    dk = config.full_attention.head_dim
    for r, local in enumerate(ranks):
        experts = "model.layers.1.mlp.experts."
        gate_up = full[experts + "gate_up_proj"]  # [E, 2I, D]: gate rows, then up rows
        assert torch.equal(local[experts + "gate_up_proj"][:, :i_r], gate_up[:, i_r * r :][:, :i_r])
        assert torch.equal(
            local[experts + "gate_up_proj"][:, i_r:], gate_up[:, i_all + i_r * r :][:, :i_r]
        )
        assert torch.equal(
            local[experts + "down_proj"], full[experts + "down_proj"][..., i_r * r :][..., :i_r]
        )
        dense = "model.layers.0.mlp."
        assert torch.equal(
            local[dense + "up_proj.weight"], full[dense + "up_proj.weight"][dense_r * r :][:dense_r]
        )
        assert torch.equal(
            local[dense + "down_proj.weight"],
            full[dense + "down_proj.weight"][:, dense_r * r :][:, :dense_r],
        )
        kv = r if full_kv == 2 else 0
        k0 = "model.layers.0.self_attn.k_proj.weight"
        assert torch.equal(local[k0], full[k0][kv * dk :][:dk])
        k1 = "model.layers.1.self_attn.k_proj.weight"  # SWA: 2 or 4 KV heads, split
        per = 2 * full_kv // 2
        assert torch.equal(local[k1], full[k1][r * per * dk :][: per * dk])
        sinks = "model.layers.1.self_attn.sinks"
        assert torch.equal(local[sinks], full[sinks][2 * r : 2 * r + 2])
        gate = "model.layers.1.mlp.gate.weight"
        assert torch.equal(local[gate], full[gate])


@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
def test_sharded_experts_add_up_to_the_full_experts_on_both_paths(
    arch: str, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory(arch=arch, num_layers=2)
    full = load_model(model_dir, RefBackend()).model.layers[1].mlp
    shards = [load_model(model_dir, RefBackend(), tp=rank(r)).model.layers[1].mlp for r in range(2)]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))  # [T, D]
    router = full.router if arch == "gpt-oss" else full.gate
    weights, index = router(x)
    want = full.experts.forward_grouped(x, index, weights)  # [T, D]
    for path in ("forward_gathered", "forward_grouped"):
        got = sum(getattr(s.experts, path)(x, index, weights) for s in shards)
        assert torch.allclose(got, want, atol=1e-6), path
    if arch == "gpt-oss":
        assert [s.experts.adds_down_bias for s in shards] == [True, False]


def test_kv_spec_and_attention_layer_per_rank(tiny_model_factory: Callable[..., Path]) -> None:
    config = load_model_config(
        tiny_model_factory(arch="mimo-v2-flash", num_layers=3, num_kv_heads=1)
    )
    assert config.kv_spec() == config.kv_spec(1)
    one, two = config.kv_spec(1), config.kv_spec(2)
    assert (one.full_layout.num_kv_heads, one.swa_layout.num_kv_heads) == (1, 2)
    assert (two.full_layout.num_kv_heads, two.swa_layout.num_kv_heads) == (1, 1)  # full replicated
    assert two.full_layout.head_dim == one.full_layout.head_dim == 24
    layer = config.attention_layer(1, 2)
    assert (layer.num_heads, layer.num_kv_heads, layer.sliding_window_size) == (2, 1, 4)


def test_configs_that_do_not_split_raise_sharding_error(
    tiny_model_factory: Callable[..., Path],
) -> None:
    config = load_model_config(tiny_model_factory(arch="gpt-oss"))
    with pytest.raises(ShardingError, match="4 attention heads do not split over tp_size=3"):
        build_model(config, RefBackend(), tp=rank(0, 3))
    six_heads = load_model_config(
        tiny_model_factory(arch="gpt-oss", num_heads=6, num_kv_heads=3, hidden_size=48)
    )
    with pytest.raises(ShardingError, match="3 KV heads do not split over tp_size=2"):
        six_heads.check_tp_size(2)
    six_heads.check_tp_size(3)
    mimo = load_model_config(
        tiny_model_factory(arch="mimo-v2-flash", num_layers=2, moe_intermediate_size=30)
    )
    with pytest.raises(
        ShardingError, match="moe intermediate_size of size 30 does not split over tp_size=4"
    ):
        mimo.check_tp_size(4)
    mimo.check_tp_size(2)


def test_a_rank_reads_only_the_slices_it_holds(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_factory(arch="gpt-oss", quantization="mxfp4")
    reads: dict[str, list[object]] = {}
    read = Checkpoint.read

    def recording_read(self: Checkpoint, name: str, index: object = None) -> torch.Tensor:
        reads.setdefault(name, []).append(index)
        return read(self, name, index)  # type: ignore[arg-type]

    monkeypatch.setattr(Checkpoint, "read", recording_read)
    load_model(model_dir, RefBackend(), tp=rank(1))
    q = "model.layers.1.self_attn.q_proj.weight"  # [H·Dk = 32, D = 32]: rank 1 rows [16, 32)
    assert reads[q] == [(slice(16, 32), slice(0, 32))]
    # gate_up_proj [E, D = 32, 2I = 64] as MXFP4 blocks [E, N = 64, 1, 16]: rank 1's N [32, 64).
    blocks = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    assert reads[blocks] == [(e, slice(32, 64), slice(0, 1)) for e in range(4)]
    # down_proj [E, I = 32, D = 32]: rank 1's K [16, 32) lies in the one group of 32 values.
    down = "model.layers.1.mlp.experts.down_proj_scales"
    assert reads[down] == [(e, slice(0, 32), slice(0, 1)) for e in range(4)]
    assert reads["model.embed_tokens.weight"] == [(slice(144, 288), slice(0, 32))]
