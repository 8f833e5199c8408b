// Linear layers over weights held in panels, called from the compiled CPU decode step without
// Python: swaserve::prepacked_linear_native (see models/prepacked.py).
//
// A traced graph passes the weight's parameter (`source`); this op runs over the copy held for
// the parameter's address, in panels: W [N, K] as [ceil(N / 16), K, 16], panel p's row k
// holding W[16p .. 16p + 15, k] (zeros past N). Python holds the copies (`prepacked.pack`) and
// mirrors them here (`hold_prepacked` / `forget_prepacked`, the latter when the parameter is
// freed).
//
// A decode step's GEMMs have a few rows and read every weight once, so what they cost is how
// fast the weights stream through the vector units: each register tile (up to 8 rows × 2
// panels of accumulators) loads a panel's 16 weights of one k once and multiplies them with
// every row's x[m, k], broadcast. Work is split over panel pairs. Each output sums its K
// products in order k = 0 .. K - 1 in one accumulator lane, whatever M is, so a row's result
// does not depend on the other rows of the batch. (oneDNN's prepacked GEMM, which this
// replaced, took 1.4-2.3x longer at 8 rows on the decode bench's shapes.)
//
// Panels are float32, or bfloat16 where every weight's float32 value is a bfloat16 value (a
// checkpoint stored in bfloat16 and computed in float32): widened to float32 as they are
// loaded, exactly, so both hold the same weights and give the same bits; the bfloat16 panels
// stream half the bytes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kPanel = 16;  // output features a panel holds
constexpr int kLanes = kPanel / Vec::size();  // vectors per panel row (1 on AVX-512, 2 on AVX2)
static_assert(kPanel % Vec::size() == 0, "a panel is a whole number of vectors");

// One vector of a panel row's weights, as float32.
inline Vec load_weights(const float* w) {
  return Vec::loadu(w);
}

inline Vec load_weights(const c10::BFloat16* w) {
  Vec out;
  at::vec::load_fp32_from_bf16(w, out);  // each value's 16 bits, shifted up: exact
  return out;
}

// Rows [0, MB) of x against panels [0, NB) (panel p's row k at panels + (p * ldp + k) * 16),
// over k in [0, K): NB * kLanes * MB accumulators. W: the panels' element type.
template <int MB, int NB, typename W>
void tile(
    const float* x, int64_t ldx, const W* panels, int64_t K, int64_t ldp, float* y,
    int64_t ldy, int64_t n0, int64_t N, const float* bias) {
  Vec acc[MB][NB][kLanes];
  for (int m = 0; m < MB; ++m)
    for (int p = 0; p < NB; ++p)
      for (int l = 0; l < kLanes; ++l) acc[m][p][l] = Vec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    Vec w[NB][kLanes];
    for (int p = 0; p < NB; ++p)
      for (int l = 0; l < kLanes; ++l)
        w[p][l] = load_weights(panels + (p * ldp + k) * kPanel + l * Vec::size());
    for (int m = 0; m < MB; ++m) {
      const Vec xv(x[m * ldx + k]);
      for (int p = 0; p < NB; ++p)
        for (int l = 0; l < kLanes; ++l) acc[m][p][l] = at::vec::fmadd(xv, w[p][l], acc[m][p][l]);
    }
  }
  for (int p = 0; p < NB; ++p) {
    for (int l = 0; l < kLanes; ++l) {
      const int64_t n = n0 + p * kPanel + l * Vec::size();
      if (n >= N) continue;
      const int64_t count = std::min<int64_t>(Vec::size(), N - n);
      Vec b(0.f);
      if (bias != nullptr) b = Vec::loadu(bias + n, count);
      for (int m = 0; m < MB; ++m) {
        const Vec out = bias != nullptr ? acc[m][p][l] + b : acc[m][p][l];
        out.store(y + m * ldy + n, count);
      }
    }
  }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t,
                        int64_t, int64_t, const float*);

// Rows of a register tile: 8 × 2 panels of accumulators fill half of AVX-512's 32 registers;
// with narrower vectors a panel row takes more of them.
constexpr int64_t kRows = Vec::size() >= 16 ? 8 : 4;

template <int NB, typename W>
TileFn<W> tile_for_rows(int64_t rows) {
  switch (rows) {
    case 1: return &tile<1, NB, W>;
    case 2: return &tile<2, NB, W>;
    case 3: return &tile<3, NB, W>;
    case 4: return &tile<4, NB, W>;
    case 5: return &tile<5, NB, W>;
    case 6: return &tile<6, NB, W>;
    case 7: return &tile<7, NB, W>;
    default: return &tile<kRows, NB, W>;
  }
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the panels of columns
// [16·2t, 16·2t + 32) (panel p at panels + p·ldp·16), plus bias: one panel pair's columns.
template <typename W>
struct Gemm {
  const float* x;
  int64_t ldx;
  const W* panels;
  int64_t K;
  int64_t ldp;
  float* y;
  int64_t ldy;
  int64_t N;
  const float* bias;

  int64_t pairs() const { return (N + 2 * kPanel - 1) / (2 * kPanel); }

  void run_pair(int64_t M, int64_t t) const {
    const int64_t p0 = 2 * t;
    const bool two = (p0 + 1) * kPanel < N;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min(kRows, M - m0);
      const TileFn<W> fn = two ? tile_for_rows<2, W>(rows) : tile_for_rows<1, W>(rows);
      fn(x + m0 * ldx, ldx, panels + p0 * ldp * kPanel, K, ldp, y + m0 * ldy, ldy, p0 * kPanel,
         N, bias);
    }
  }
};

// f(the panels' elements): `const float*` or `const c10::BFloat16*`.
template <typename F>
void with_panels(const at::Tensor& panels, const char* op, const F& f) {
  if (panels.scalar_type() == at::kBFloat16) {
    f(panels.const_data_ptr<c10::BFloat16>());
    return;
  }
  TORCH_CHECK(panels.scalar_type() == at::kFloat, "swaserve::", op,
              ": panels must be float32 or bfloat16, got ", panels.scalar_type());
  f(panels.const_data_ptr<float>());
}

template <typename P>
using Element = std::remove_cv_t<std::remove_pointer_t<P>>;

at::Tensor panel_linear(
    const at::Tensor& x_in,
    const at::Tensor& panels_in,
    const std::optional<at::Tensor>& bias_in,
    int64_t out_features) {
  TORCH_CHECK(x_in.device().is_cpu() && panels_in.device().is_cpu(), "prepacked_linear runs on CPU");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "prepacked_linear: x must be float32");
  TORCH_CHECK(
      panels_in.dim() == 3 && panels_in.size(2) == kPanel,
      "prepacked_linear: panels must be [P, K, ", kPanel, "], got ", panels_in.sizes());
  const int64_t K = panels_in.size(1), P = panels_in.size(0), N = out_features;
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "prepacked_linear: x's last dim must be ", K);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "prepacked_linear: ", N,
              " output features do not fill the ", P, " panels");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const at::Tensor panels = panels_in.contiguous();
  std::optional<at::Tensor> bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->scalar_type() == at::kFloat && bias_in->numel() == N,
                "prepacked_linear: bias must be float32 [", N, "]");
    bias = bias_in->contiguous();
  }
  const int64_t M = x.size(0);
  std::vector<int64_t> shape = x_in.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0) {
    const float* xp = x.data_ptr<float>();
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    with_panels(panels, "prepacked_linear", [&](const auto* pp) {
      const Gemm<Element<decltype(pp)>> gemm{xp, K, pp, K, K, yp, N, N, bp};
      at::parallel_for(0, gemm.pairs(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) gemm.run_pair(M, t);
      });
    });
  }
  return y.view(shape);
}

struct Held {
  at::Tensor packed;  // the panels
  std::vector<int64_t> shape;  // the source's
  int64_t out_features;
};

std::shared_mutex held_mutex;

std::unordered_map<int64_t, Held>& held() {
  static std::unordered_map<int64_t, Held> copies;  // source address → its copy
  return copies;
}

int64_t address_of(const at::Tensor& t) {
  return reinterpret_cast<int64_t>(t.data_ptr());
}

void hold_prepacked(const at::Tensor& source, const at::Tensor& packed, int64_t out_features) {
  std::unique_lock<std::shared_mutex> lock(held_mutex);
  held()[address_of(source)] = Held{packed, source.sizes().vec(), out_features};
}

void forget_prepacked(int64_t address) {
  std::unique_lock<std::shared_mutex> lock(held_mutex);
  held().erase(address);
}

at::Tensor held_panels(const at::Tensor& source, int64_t out_features, const char* op) {
  std::shared_lock<std::shared_mutex> lock(held_mutex);
  const auto it = held().find(address_of(source));
  TORCH_CHECK(
      it != held().end() && it->second.shape == source.sizes().vec(), "swaserve::", op,
      ": no prepacked weight is held for the ", source.sizes(),
      " tensor it was given (prepacked.pack it first)");
  TORCH_CHECK(
      it->second.out_features == out_features, "swaserve::", op, ": the copy held has ",
      it->second.out_features, " output features, the call asks for ", out_features);
  return it->second.packed;
}

at::Tensor prepacked_linear_native(
    const at::Tensor& x,
    const at::Tensor& source,
    const std::optional<at::Tensor>& bias,
    int64_t out_features) {
  return panel_linear(x, held_panels(source, out_features, "prepacked_linear_native"), bias,
                      out_features);
}

// The (token, expert) pairs of `experts` [T, k] grouped by expert: pair ids in expert order,
// and where each expert's run starts (E + 1 entries).
struct Groups {
  std::vector<int64_t> order;
  std::vector<int64_t> start;
  std::vector<int64_t> slot;  // slot[pair]: its index in `order`

  Groups(const at::Tensor& experts, int64_t E) : start(E + 1, 0) {
    const int64_t n = experts.numel();
    const int64_t* ep = experts.data_ptr<int64_t>();
    for (int64_t p = 0; p < n; ++p) {
      TORCH_CHECK(ep[p] >= 0 && ep[p] < E, "swaserve: expert ", ep[p], " of ", E);
      ++start[ep[p] + 1];
    }
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    order.resize(n);
    slot.resize(n);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < n; ++p) {
      slot[p] = next[ep[p]]++;
      order[slot[p]] = p;
    }
  }

  // One GEMM per expert with pairs; `gemm(e)` describes it; all panel pairs run in parallel.
  template <typename MakeGemm>
  void run(int64_t E, const MakeGemm& gemm) const {
    std::vector<std::pair<int64_t, int64_t>> items;  // (expert, panel pair)
    for (int64_t e = 0; e < E; ++e) {
      if (start[e + 1] == start[e]) continue;
      const int64_t pairs = gemm(e).pairs();
      for (int64_t t = 0; t < pairs; ++t) items.emplace_back(e, t);
    }
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto [e, t] = items[i];
        gemm(e).run_pair(start[e + 1] - start[e], t);
      }
    });
  }
};

at::Tensor long_contiguous(const at::Tensor& t) {
  return t.to(at::kLong).contiguous();
}

// out[t, j] = x[t] W_e^T + bias_e for e = experts[t, j], W_e = rows [e F, (e + 1) F) of the
// stacked weight held for `source` (out_features = E F): only the pairs' experts run.
at::Tensor prepacked_expert_linear(
    const at::Tensor& x_in,
    const at::Tensor& source,
    const std::optional<at::Tensor>& bias_in,
    int64_t out_features,
    const at::Tensor& experts_in,
    int64_t expert_features) {
  const char* op = "prepacked_expert_linear";
  const at::Tensor panels = held_panels(source, out_features, op);
  const int64_t F = expert_features, K = panels.size(1);
  TORCH_CHECK(F > 0 && F % kPanel == 0 && out_features % F == 0, "swaserve::", op, ": ",
              F, " features an expert must be a multiple of ", kPanel, " dividing ",
              out_features);
  const int64_t E = out_features / F;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && x_in.scalar_type() == at::kFloat,
              "swaserve::", op, ": x must be float32 [T, ", K, "]");
  TORCH_CHECK(experts_in.dim() == 2 && experts_in.size(0) == x_in.size(0),
              "swaserve::", op, ": experts must be [T, k]");
  const at::Tensor x = x_in.contiguous(), experts = long_contiguous(experts_in);
  const int64_t T = x.size(0), k = experts.size(1), n = T * k;
  const float* bp = nullptr;
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->scalar_type() == at::kFloat && bias_in->numel() == out_features,
                "swaserve::", op, ": bias must be float32 [", out_features, "]");
    bias = bias_in->contiguous();
    bp = bias.data_ptr<float>();
  }
  at::Tensor out = at::empty({T, k, F}, x.options());
  if (n == 0) return out;
  const Groups groups(experts, E);
  at::Tensor xg = at::empty({n, K}, x.options()), yg = at::empty({n, F}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xgp = xg.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::copy_n(xp + (groups.order[i] / k) * K, K, xgp + i * K);
  float* ygp = yg.data_ptr<float>();
  with_panels(panels, op, [&](const auto* pp) {
    groups.run(E, [&](int64_t e) {
      const int64_t row = groups.start[e];
      return Gemm<Element<decltype(pp)>>{xgp + row * K, K, pp + e * (F / kPanel) * K * kPanel,
                                         K, K, ygp + row * F, F, F,
                                         bp == nullptr ? nullptr : bp + e * F};
    });
  });
  float* op_out = out.data_ptr<float>();
  for (int64_t p = 0; p < n; ++p) std::copy_n(ygp + groups.slot[p] * F, F, op_out + p * F);
  return out;
}

// y[t] = Σ_j weights[t, j] · h[t, j] W_e^T for e = experts[t, j] (in j order), W_e = inputs
// [e I, (e + 1) I) of the stacked weight held for `source` ([out_features, E I]).
at::Tensor prepacked_expert_linear_in(
    const at::Tensor& h_in,
    const at::Tensor& source,
    int64_t out_features,
    const at::Tensor& experts_in,
    const at::Tensor& weights_in,
    int64_t expert_inputs) {
  const char* op = "prepacked_expert_linear_in";
  const at::Tensor panels = held_panels(source, out_features, op);
  const int64_t I = expert_inputs, Ktot = panels.size(1), D = out_features;
  TORCH_CHECK(I > 0 && Ktot % I == 0, "swaserve::", op, ": ", I,
              " inputs an expert must divide the weight's ", Ktot);
  const int64_t E = Ktot / I;
  TORCH_CHECK(h_in.dim() == 3 && h_in.size(2) == I && h_in.scalar_type() == at::kFloat,
              "swaserve::", op, ": h must be float32 [T, k, ", I, "]");
  TORCH_CHECK(experts_in.sizes() == h_in.sizes().slice(0, 2) &&
                  weights_in.sizes() == experts_in.sizes(),
              "swaserve::", op, ": experts and weights must be [T, k] as h");
  const at::Tensor h = h_in.contiguous(), experts = long_contiguous(experts_in);
  const at::Tensor weights = weights_in.to(at::kFloat).contiguous();
  const int64_t T = h.size(0), k = h.size(1), n = T * k;
  at::Tensor y = at::zeros({T, D}, h.options());
  if (n == 0) return y;
  const Groups groups(experts, E);
  at::Tensor hg = at::empty({n, I}, h.options()), yg = at::empty({n, D}, h.options());
  const float* hp = h.data_ptr<float>();
  float* hgp = hg.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::copy_n(hp + groups.order[i] * I, I, hgp + i * I);
  float* ygp = yg.data_ptr<float>();
  with_panels(panels, op, [&](const auto* pp) {
    groups.run(E, [&](int64_t e) {
      const int64_t row = groups.start[e];
      return Gemm<Element<decltype(pp)>>{hgp + row * I, I, pp + e * I * kPanel, I, Ktot,
                                         ygp + row * D, D, D, nullptr};
    });
  });
  const float* wp = weights.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* out = yp + t * D;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = t * k + j;
      const float w = wp[p];
      const float* part = ygp + groups.slot[p] * D;
      for (int64_t d = 0; d < D; ++d) out[d] += w * part[d];
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(swaserve, m) {
  m.def("hold_prepacked(Tensor source, Tensor packed, int out_features) -> ()", &hold_prepacked);
  m.def("forget_prepacked(int address) -> ()", &forget_prepacked);
  m.def(
      "prepacked_linear_native(Tensor x, Tensor source, Tensor? bias, int out_features) -> "
      "Tensor");
  m.def(
      "prepacked_expert_linear(Tensor x, Tensor source, Tensor? bias, int out_features, "
      "Tensor experts, int expert_features) -> Tensor");
  m.def(
      "prepacked_expert_linear_in(Tensor h, Tensor source, int out_features, Tensor experts, "
      "Tensor weights, int expert_inputs) -> Tensor");
}

TORCH_LIBRARY_IMPL(swaserve, CPU, m) {
  m.impl("prepacked_linear_native", &prepacked_linear_native);
  m.impl("prepacked_expert_linear", &prepacked_expert_linear);
  m.impl("prepacked_expert_linear_in", &prepacked_expert_linear_in);
}
