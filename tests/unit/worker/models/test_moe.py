"""Batched MoE experts (gathered weights for few tokens, sorted-by-expert bmm for many, the
static step's GEMMs over prepacked stacked weights) against the per-expert loop they replaced,
on GPT-OSS and MiMo-V2-Flash layouts, float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swaserve.worker.attention import cpu_kernels
from swaserve.worker.models import prepacked
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.gpt_oss import GptOssExperts
from swaserve.worker.models.layers import BatchedExperts, gathers_expert_weights, sort_by_expert
from swaserve.worker.models.mimo_v2_flash import MiMoV2FlashExperts
from swaserve.worker.models.static_step import static_shapes
from swaserve.worker.models.tiny import make_tiny_model
from swaserve.worker.runner.parallel import TPGroup

TOLERANCE = 1e-5
NUM_EXPERTS, TOP_K, HIDDEN = 8, 3, 32


def reference_groups(top_k_index: torch.Tensor, num_experts: int):
    """The old grouping: for each expert any token chose, ascending: (expert, rows, slots)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            picks = order[start : start + count]
            yield expert, picks // k, picks % k
        start += count


def reference_gpt_oss(experts: GptOssExperts, x, top_k_index, top_k_weights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e, rows, slots in reference_groups(top_k_index, experts.num_experts):
        gate_up = x[rows] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        y = experts.activation(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]
        out.index_add_(0, rows, (y * top_k_weights[rows, slots, None]).to(x.dtype))
    return out


def reference_mimo(experts: MiMoV2FlashExperts, x, top_k_index, top_k_weights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e, rows, slots in reference_groups(top_k_index, experts.num_experts):
        gate, up = F.linear(x[rows], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, experts.down_proj[e])
        out.index_add_(0, rows, (y * top_k_weights[rows, slots, None]).to(x.dtype))
    return out


def make_experts(arch: str, tmp_path) -> GptOssExperts | MiMoV2FlashExperts:
    model_dir = make_tiny_model(
        tmp_path,
        arch=arch,
        num_layers=2,
        sliding_window_size=2,
        hidden_size=HIDDEN,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        **({"swiglu_limit": 0.5} if arch == "gpt-oss" else {}),
    )
    config = load_model_config(model_dir)
    gen = torch.Generator().manual_seed(5)
    experts: GptOssExperts | MiMoV2FlashExperts
    if arch == "gpt-oss":
        experts = GptOssExperts(config, dtype=torch.float32)
    else:
        experts = MiMoV2FlashExperts(config, dtype=torch.float32)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return experts


def random_routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids drawn from experts 0..5 only (6 and 7 are chosen by no token), with the
    first four tokens all choosing the same expert set {1, 4, 2} in different orders."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack(
        [torch.randperm(NUM_EXPERTS - 2, generator=gen)[:TOP_K] for _ in range(num_tokens)]
    )  # [T, k] int64
    same = torch.tensor([[1, 4, 2], [4, 2, 1], [2, 1, 4], [1, 4, 2]])  # [4, k] int64
    index[: min(4, num_tokens)] = same[:num_tokens]
    weights = torch.rand(num_tokens, TOP_K, generator=gen)  # [T, k] float32
    return index, weights / weights.sum(dim=1, keepdim=True)


REFERENCES = {"gpt-oss": reference_gpt_oss, "mimo-v2-flash": reference_mimo}


@pytest.mark.parametrize("arch", sorted(REFERENCES))
@pytest.mark.parametrize("path", ["forward_gathered", "forward_grouped"])
@pytest.mark.parametrize("num_tokens", [1, 4, 37])
def test_batched_experts_equal_the_per_expert_loop(
    arch: str, path: str, num_tokens: int, tmp_path
) -> None:
    experts = make_experts(arch, tmp_path)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    index, weights = random_routing(num_tokens, seed=num_tokens)
    with torch.no_grad():
        ours = getattr(experts, path)(x, index, weights)  # [T, D]
        theirs = REFERENCES[arch](experts, x, index, weights)  # [T, D]
    assert ours.shape == (num_tokens, HIDDEN)
    assert theirs.abs().max().item() > 0.1  # the experts do produce something to compare
    assert (ours - theirs).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("arch", sorted(REFERENCES))
def test_forward_gathers_while_pairs_fit_experts_and_budget(
    arch: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    experts = make_experts(arch, tmp_path)
    assert experts.expert_elements == 3 * HIDDEN * HIDDEN
    taken: list[str] = []
    for name in ("forward_gathered", "forward_grouped"):
        original = getattr(experts, name)
        monkeypatch.setattr(
            experts, name, lambda *a, _name=name, _f=original: taken.append(_name) or _f(*a)
        )

    def run(num_tokens: int) -> None:
        index, weights = random_routing(num_tokens, seed=0)
        with torch.no_grad():
            experts(torch.randn(num_tokens, HIDDEN), index, weights)

    run(2)  # on CPU: 6 pairs over 8 experts go grouped (a host read is free there)
    assert taken == ["forward_grouped"]
    taken.clear()
    # The rule for a device where the gather saves a sync (CUDA), applied to these CPU tensors.
    monkeypatch.setattr(
        "swaserve.worker.models.layers.gathers_expert_weights",
        lambda n, e, el, device=None: gathers_expert_weights(n, e, el),
    )
    run(2)  # 6 pairs ≤ 8 experts
    run(3)  # 9 pairs > 8 experts
    monkeypatch.setattr(
        "swaserve.worker.models.layers.GATHER_BUDGET_ELEMENTS", 5 * experts.expert_elements
    )
    run(2)  # 6 pairs' weights exceed a 5-pair budget
    assert taken == ["forward_gathered", "forward_grouped", "forward_grouped"]


def test_gather_rule_on_real_expert_sizes() -> None:
    per_expert = 3 * 2880 * 2880  # GPT-OSS-120b: D = I = 2880, 128 experts, top-4
    assert gathers_expert_weights(1 * 4, 128, per_expert)
    assert not gathers_expert_weights(2 * 4, 128, per_expert)  # over the budget
    assert gathers_expert_weights(8, 8, 3 * 32 * 32)
    assert not gathers_expert_weights(9, 8, 3 * 32 * 32)  # more pairs than experts
    cpu = torch.device("cpu")
    assert not gathers_expert_weights(4, 8, 3 * 32 * 32, cpu)  # grouped computes only 2x the need
    assert gathers_expert_weights(3, 8, 3 * 32 * 32, cpu)  # grouped would compute 8 of 3
    assert gathers_expert_weights(1 * 4, 128, per_expert, cpu)


def test_sort_by_expert_pads_each_group_to_the_largest() -> None:
    index = torch.tensor([[2, 0], [2, 3], [0, 2]])  # [T=3, k=2]; expert 1 chosen by no token
    groups = sort_by_expert(index, num_experts=4)
    # expert 0: tokens 0, 2; expert 1: none; expert 2: tokens 0, 1, 2; expert 3: token 1.
    assert groups.token_rows.tolist() == [[0, 2, 0], [0, 0, 0], [0, 1, 2], [1, 0, 0]]
    assert groups.expert.tolist() == [0, 0, 2, 2, 2, 3]
    assert groups.position.tolist() == [0, 1, 0, 1, 2, 0]
    assert groups.token.tolist() == [0, 2, 0, 1, 2, 1]
    assert groups.pair.tolist() == [1, 4, 0, 2, 5, 3]


@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("arch", sorted(REFERENCES))
@pytest.mark.parametrize("num_tokens", [1, 2, 37])
def test_prepacked_experts_equal_the_per_expert_loop(
    arch: str, num_tokens: int, path: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The static step's paths over the prepacked stacked weights: each token through its own
    experts (`sparse`: our C++ kernels, any number of tokens) or every expert over every token
    (`dense`: without the kernels, where one token gathers its experts' weights); and the eager
    paths unchanged beside them."""
    taken: list[str] = []
    if path == "sparse":
        if cpu_kernels.load() is None:
            pytest.skip("the C++ kernels did not build here")
        sparse = BatchedExperts.forward_prepacked_sparse

        def spy(self, *args):
            taken.append("sparse")
            return sparse(self, *args)

        monkeypatch.setattr(BatchedExperts, "forward_prepacked_sparse", spy)
    else:
        monkeypatch.setattr(prepacked, "experts_run_sparse", lambda features: False)
    experts = make_experts(arch, tmp_path)
    i = experts.down_proj.shape[1 if arch == "gpt-oss" else 2]
    stacked = 3 * NUM_EXPERTS * HIDDEN * i
    bias = NUM_EXPERTS * 2 * i if arch == "gpt-oss" else 0  # the de-interleaved gate/up bias
    assert experts.prepack_weights() == (stacked + bias) * 4
    assert experts.prepacked
    assert experts.stacked_out_features == (stacked // 3 * 2 // HIDDEN, HIDDEN)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    index, weights = random_routing(num_tokens, seed=num_tokens)
    with torch.no_grad():
        theirs = REFERENCES[arch](experts, x, index, weights)
        with static_shapes():
            ours = experts(x, index, weights)
        eager = experts(x, index, weights)
    assert (ours - theirs).abs().max().item() < TOLERANCE
    assert (eager - theirs).abs().max().item() < TOLERANCE
    assert taken == (["sparse"] if path == "sparse" else [])


def rank_experts(
    full: GptOssExperts | MiMoV2FlashExperts, arch: str, tmp_path, rank: int
) -> GptOssExperts | MiMoV2FlashExperts:
    """TP rank `rank` of 2's experts, holding its slices of `full`'s weights."""
    config = load_model_config(tmp_path)
    tp = TPGroup(rank=rank, world_size=2)
    i = full.down_proj.shape[1 if arch == "gpt-oss" else 2] // 2  # I_r
    part = slice(rank * i, (rank + 1) * i)
    experts: GptOssExperts | MiMoV2FlashExperts
    with torch.no_grad():
        if isinstance(full, GptOssExperts):
            experts = GptOssExperts(config, dtype=torch.float32, tp=tp)
            columns = slice(2 * part.start, 2 * part.stop)
            experts.gate_up_proj.copy_(full.gate_up_proj[:, :, columns])
            experts.gate_up_proj_bias.copy_(full.gate_up_proj_bias[:, columns])
            experts.down_proj.copy_(full.down_proj[:, part])
            experts.down_proj_bias.copy_(full.down_proj_bias)
        else:
            experts = MiMoV2FlashExperts(config, dtype=torch.float32, tp=tp)
            up = slice(2 * i + part.start, 2 * i + part.stop)
            experts.gate_up_proj.copy_(
                torch.cat([full.gate_up_proj[:, part], full.gate_up_proj[:, up]], 1)
            )
            experts.down_proj.copy_(full.down_proj[:, :, part])
    return experts


@pytest.mark.parametrize("arch", sorted(REFERENCES))
def test_prepacked_tp_ranks_sum_to_the_whole(arch: str, tmp_path) -> None:
    """Each TP rank's prepacked experts give its partial output (the down bias on rank 0 only);
    their sum is the unsharded experts' output."""
    full = make_experts(arch, tmp_path)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(1))
    index, weights = random_routing(6, seed=1)
    with torch.no_grad():
        want = REFERENCES[arch](full, x, index, weights)
        total = torch.zeros_like(want)
        for rank in range(2):
            experts = rank_experts(full, arch, tmp_path, rank)
            experts.prepack_weights()
            with static_shapes():
                total += experts(x, index, weights)
    assert (total - want).abs().max().item() < TOLERANCE
