// Decode attention on CPU over the pool rows themselves: swaserve::decode_attention.
//
// One-token queries [B, H, Dk] read keys and values [R, Hkv, D] at the pool rows `slots` [B, L],
// with an additive mask `bias` [B, L] (0 on a key, -inf on padding) and optional per-head sink
// logits [H], as `sdpa.attention` computes them. Work is split over requests; each reads its L
// slots once, each key's whole pool row (every KV head) at a time, scores its H query heads
// (head h reads KV head h / (H / Hkv)) and accumulates the values with the softmax weights (two
// passes over the keys: scores, then values). Where Dk and Dv are a multiple of the vector width
// and at most 8 vectors, both passes are unrolled over the head's vectors: the query heads of a
// KV head read its key vectors once from registers, and each head's output accumulates in
// registers over the keys (GPT-OSS's decode bench: 2.1x faster at 160 keys, 1.4x at 33, than
// loops over memory). Built at start by `cpu_kernels.load` with the vector ISA inductor picks
// for this machine.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

float lane_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  }
  float sum = lane_sum(acc);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

void add_scaled(float p, const float* x, float* y, int64_t n) {
  const Vec pv(p);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(pv, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  }
  for (; d < n; ++d) y[d] += p * x[d];
}

// Every query head's score against one key (its row: every KV head), the query heads of a
// KV head reading its key vectors once: NK vectors of Dk (Dk <= 128 floats).
struct ScoreKey {
  using Fn = void (*)(const float*, const float*, int64_t, int64_t, float, float, int64_t, int64_t, float*, float*);

  template <int NK>
  static void run(
      const float* queries, const float* keys, int64_t H, int64_t G, float scale, float mask,
      int64_t L, int64_t l, float* scores, float* top) {
    for (int64_t g = 0; g < H / G; ++g) {
      Vec k[NK];
      for (int j = 0; j < NK; ++j) k[j] = Vec::loadu(keys + (g * NK + j) * Vec::size());
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        const float* q = queries + h * NK * Vec::size();
        Vec acc = Vec::loadu(q) * k[0];
        for (int j = 1; j < NK; ++j) acc = at::vec::fmadd(Vec::loadu(q + j * Vec::size()), k[j], acc);
        const float s = lane_sum(acc) * scale + mask;
        scores[h * L + l] = s;
        top[h] = std::max(top[h], s);
      }
    }
  }
};

// out[h] = Σ_l p[h][l] · V[l] for one query head, over NV vectors of Dv: the accumulators stay
// in registers (NV <= 8, Dv <= 128 floats).
struct WeighValues {
  using Fn = void (*)(const float*, int64_t, const int64_t*, const float*, int64_t, int64_t, float*);

  template <int NV>
  static void run(
      const float* scores, int64_t L, const int64_t* row, const float* vp, int64_t stride,
      int64_t offset, float* out) {
    Vec acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = Vec(0.f);
    for (int64_t l = 0; l < L; ++l) {
      const float p = scores[l];
      if (p == 0.f) continue;
      const Vec pv(p);
      const float* values = vp + row[l] * stride + offset;
      for (int j = 0; j < NV; ++j) {
        acc[j] = at::vec::fmadd(pv, Vec::loadu(values + j * Vec::size()), acc[j]);
      }
    }
    for (int j = 0; j < NV; ++j) acc[j].store(out + j * Vec::size());
  }
};

// `Kernel::run<N>` for a head of `dim` floats, N = dim / the vector width, 1 to 8; nullptr for
// another `dim` (the caller loops over memory then).
template <typename Kernel>
typename Kernel::Fn unrolled_for(int64_t dim) {
  if (dim % Vec::size() != 0) return nullptr;
  switch (dim / Vec::size()) {
    case 1: return &Kernel::template run<1>;
    case 2: return &Kernel::template run<2>;
    case 3: return &Kernel::template run<3>;
    case 4: return &Kernel::template run<4>;
    case 5: return &Kernel::template run<5>;
    case 6: return &Kernel::template run<6>;
    case 7: return &Kernel::template run<7>;
    case 8: return &Kernel::template run<8>;
    default: return nullptr;
  }
}

at::Tensor decode_attention(
    const at::Tensor& q,
    const at::Tensor& k_buf,
    const at::Tensor& v_buf,
    const at::Tensor& slots,
    const at::Tensor& bias,
    double scaling,
    const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buf, v_buf must be 3-d");
  TORCH_CHECK(slots.dim() == 2 && bias.sizes() == slots.sizes(), "slots and bias must be [B, L]");
  TORCH_CHECK(
      q.scalar_type() == at::kFloat && k_buf.scalar_type() == at::kFloat &&
          v_buf.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat,
      "q, k_buf, v_buf and bias must be float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slots must be int64");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "the pool buffers must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), Dk = q.size(2);
  const int64_t R = k_buf.size(0), Hkv = k_buf.size(1), Dv = v_buf.size(2), L = slots.size(1);
  TORCH_CHECK(slots.size(0) == B && k_buf.size(2) == Dk, "shapes of q, k_buf and slots disagree");
  TORCH_CHECK(v_buf.size(0) == R && v_buf.size(1) == Hkv, "k_buf and v_buf disagree");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(L > 0, "every query needs at least one key");
  std::optional<at::Tensor> sink_values;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == H, "sinks must be [H] float32");
    sink_values = sinks->contiguous();
  }
  const int64_t G = H / Hkv;
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), bc = bias.contiguous();
  at::Tensor out = at::empty({B, H, Dv}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_buf.data_ptr<float>();
  const float* vp = v_buf.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const float* bp = bc.data_ptr<float>();
  const float* sinkp = sink_values.has_value() ? sink_values->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  for (int64_t i = 0; i < B * L; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < R, "a slot is outside the pool: ", sp[i]);
  }
  const WeighValues::Fn weigh = unrolled_for<WeighValues>(Dv);
  const ScoreKey::Fn score = unrolled_for<ScoreKey>(Dk);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(H * L), top(H), total(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* row = sp + b * L;
      const float* mask = bp + b * L;
      const float* queries = qp + b * H * Dk;
      float* outs = op + b * H * Dv;
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      // The keys up to the last one the mask shows: the padding after it adds exact zeros, so
      // skipping it changes nothing but the sums' grouping, which then depends on the row
      // alone, not on the batch's width (a row's result is the same in any batch).
      int64_t n = L;
      while (n > 1 && mask[n - 1] == -std::numeric_limits<float>::infinity()) --n;
      for (int64_t l = 0; l < n; ++l) {
        const float* keys = kp + row[l] * Hkv * Dk;  // the key's row: every KV head
        if (score != nullptr) {
          score(queries, keys, H, G, scale, mask[l], L, l, scores.data(), top.data());
          continue;
        }
        for (int64_t h = 0; h < H; ++h) {
          const float s = dot(queries + h * Dk, keys + (h / G) * Dk, Dk) * scale + mask[l];
          scores[h * L + l] = s;
          top[h] = std::max(top[h], s);
        }
      }
      for (int64_t h = 0; h < H; ++h) {  // scores → exp(score - max), in place, and their sum
        float* ps = scores.data() + h * L;
        const Vec shift(top[h]);
        Vec acc(0.f);
        int64_t l = 0;
        for (; l + Vec::size() <= n; l += Vec::size()) {
          const Vec p = (Vec::loadu(ps + l) - shift).exp();
          p.store(ps + l);
          acc = acc + p;
        }
        total[h] = lane_sum(acc);
        for (; l < n; ++l) {
          ps[l] = std::exp(ps[l] - top[h]);
          total[h] += ps[l];
        }
      }
      if (weigh != nullptr) {
        for (int64_t h = 0; h < H; ++h) {
          weigh(scores.data() + h * L, n, row, vp, Hkv * Dv, (h / G) * Dv, outs + h * Dv);
        }
      } else {
        std::fill(outs, outs + H * Dv, 0.f);
        for (int64_t l = 0; l < n; ++l) {
          const float* values = vp + row[l] * Hkv * Dv;
          for (int64_t h = 0; h < H; ++h) {
            const float p = scores[h * L + l];
            if (p != 0.f) add_scaled(p, values + (h / G) * Dv, outs + h * Dv, Dv);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float factor = 1.f / total[h];
        if (sinkp != nullptr) {
          const float lse = top[h] + std::log(total[h]);
          factor /= 1.f + std::exp(sinkp[h] - lse);
        }
        float* o = outs + h * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] *= factor;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(swaserve, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor bias, "
      "float scaling, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(swaserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
