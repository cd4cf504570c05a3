// Attention of one query token per request over that request's own KV, on a CPU, in float32.
//
// One call serves every one-token row of a decode step (a layer at a time). Each (row, KV head)
// is computed start to end by one thread, in an order that depends on nothing but that row, so a
// request's result does not depend on who shares its step or on the thread count. K and V are
// read once per KV head for all the query heads that share it (GQA), as float32 or bfloat16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head

// 16 float32 lanes (GCC and Clang vector extensions: AVX-512 registers where the CPU has them,
// pairs or quads of narrower ones where it does not)
typedef float Lanes16 __attribute__((vector_size(64)));
typedef uint16_t Bf16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));

inline Lanes16 load_lanes(const float* p) {
  Lanes16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Lanes16 load_lanes(const uint16_t* p) {  // bfloat16: the upper halves of float32s
  Bf16x16 bits;
  std::memcpy(&bits, p, sizeof bits);
  const U32x16 wide = __builtin_convertvector(bits, U32x16) << 16;
  Lanes16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// e^x for x <= 0 (a score minus the row's maximum): 2^n * p(r) with Cephes' polynomial, within
// 2 ulp; written so the compiler vectorises it, where the math library's expf is a call per element.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// The lane sums of 16 vectors acc[p], one per position p, as one vector. Each is summed in a fixed
// order, halves added onto each other (lane i + lane i+8, then i + i+4, then (0 + 2) + (1 + 3)), as
// one vector's sum would be; shuffles of two vectors bring 16 positions' halves into line so that
// one add serves them all (a compiler's own reduction adds a vector's lanes one after another:
// a chain of 16 dependent adds per dot product).
inline Lanes16 sum_lanes_of_16(const Lanes16* acc) {
  Lanes16 halves[8];  // halves[m]: lanes 0-7 position 2m's halves, lanes 8-15 position 2m+1's
  for (int m = 0; m < 8; ++m)
    halves[m] = __builtin_shufflevector(acc[2 * m], acc[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                        21, 22, 23) +
                __builtin_shufflevector(acc[2 * m], acc[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                        28, 29, 30, 31);
  Lanes16 quarters[4];  // quarters[m]: 4 lanes for each of positions 4m to 4m+3
  for (int m = 0; m < 4; ++m)
    quarters[m] = __builtin_shufflevector(halves[2 * m], halves[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                          19, 24, 25, 26, 27) +
                  __builtin_shufflevector(halves[2 * m], halves[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                          22, 23, 28, 29, 30, 31);
  Lanes16 pairs[2];  // pairs[m]: lanes k < 8 quarter[0] + quarter[2] of position 8m+k, lanes 8+k quarter[1] + quarter[3]
  for (int m = 0; m < 2; ++m)
    pairs[m] = __builtin_shufflevector(quarters[2 * m], quarters[2 * m + 1], 0, 4, 8, 12, 16, 20, 24, 28, 1, 5,
                                       9, 13, 17, 21, 25, 29) +
               __builtin_shufflevector(quarters[2 * m], quarters[2 * m + 1], 2, 6, 10, 14, 18, 22, 26, 30, 3, 7,
                                       11, 15, 19, 23, 27, 31);
  return __builtin_shufflevector(pairs[0], pairs[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(pairs[0], pairs[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// The G query heads q [G, D] that share one KV head, over its L positions k, v [L, D]:
// out[g] = softmax(q[g] . k^T * scale) v. scores is room for G * round_up(L, 16) floats.
template <int64_t D, typename KV>
void attend_group(const float* q, const KV* k, const KV* v, int64_t L, int64_t G, float scale, float* scores,
                  float* out) {
  static_assert(D % 16 == 0, "head_dim a multiple of 16");
  constexpr int64_t C = D / 16;  // lane groups per head
  const int64_t stride = (L + 15) / 16 * 16;  // each head's scores, room for a whole last block
  Lanes16 qg[kMaxGroup][C];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) qg[g][c] = load_lanes(q + g * D + c * 16);
  for (int64_t j0 = 0; j0 < L; j0 += 16) {  // scores, 16 positions at a time: their K read once for the G heads
    Lanes16 kb[16][C];
    const int64_t n = L - j0 < 16 ? L - j0 : 16;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t c = 0; c < C; ++c) kb[p][c] = load_lanes(k + (j0 + p) * D + c * 16);
    for (int64_t p = n; p < 16; ++p)  // past the last position: scored as zeros and never read
      for (int64_t c = 0; c < C; ++c) kb[p][c] = Lanes16{};
    for (int64_t g = 0; g < G; ++g) {
      Lanes16 acc[16];
      for (int64_t p = 0; p < 16; ++p) {
        acc[p] = qg[g][0] * kb[p][0];
        for (int64_t c = 1; c < C; ++c) acc[p] += qg[g][c] * kb[p][c];
      }
      const Lanes16 scored = sum_lanes_of_16(acc) * scale;
      std::memcpy(scores + g * stride + j0, &scored, sizeof scored);
    }
  }
  float inverse_total[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {  // softmax, its division left to the end
    float* sg = scores + g * stride;
    float m = sg[0];
#pragma omp simd reduction(max : m)
    for (int64_t j = 1; j < L; ++j) m = sg[j] > m ? sg[j] : m;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < L; ++j) {
      const float e = exp_nonpositive(sg[j] - m);
      sg[j] = e;
      total += e;
    }
    inverse_total[g] = 1.f / total;
  }
  Lanes16 acc[kMaxGroup][C] = {};
  for (int64_t j = 0; j < L; ++j) {  // the weighted sum of V: each position's V read once
    Lanes16 vj[C];
    for (int64_t c = 0; c < C; ++c) vj[c] = load_lanes(v + j * D + c * 16);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * stride + j];
      for (int64_t c = 0; c < C; ++c) acc[g][c] += p * vj[c];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < C; ++c) {
      const Lanes16 scaled = acc[g][c] * inverse_total[g];
      std::memcpy(out + g * D + c * 16, &scaled, sizeof scaled);
    }
  }
}

template <int64_t D>
void attend_rows(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                 float scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = keys[0].size(-3), group = heads / kv_heads;
  const bool bf16 = keys[0].scalar_type() == at::kBFloat16;
  const float* q_data = q.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / rows, r = item % rows;  // a KV head's rows one after another
      const at::Tensor& k = keys[r];
      const at::Tensor& v = values[r];
      const int64_t length = k.size(-2);
      scores.resize(group * ((length + 15) / 16 * 16));
      const int64_t first = (r * heads + h * group) * D;
      if (bf16) {
        const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()) + h * k.stride(-3);
        const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()) + h * v.stride(-3);
        attend_group<D>(q_data + first, kp, vp, length, group, scale, scores.data(), out_data + first);
      } else {
        const float* kp = k.data_ptr<float>() + h * k.stride(-3);
        const float* vp = v.data_ptr<float>() + h * v.stride(-3);
        attend_group<D>(q_data + first, kp, vp, length, group, scale, scores.data(), out_data + first);
      }
    }
  });
}

}  // namespace

// q [rows, heads, D] float32; keys[r], values[r] [..., kv_heads, L_r, D], float32 or bfloat16, each
// position's D values contiguous (a narrowed view of a request's KV buffer). Returns [rows, heads, D].
at::Tensor decode_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "q must be a contiguous float32 CPU tensor [rows, heads, head_dim]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(rows > 0 && int64_t(keys.size()) == rows && int64_t(values.size()) == rows,
              "one K and one V per row of q");
  const int64_t kv_heads = keys[0].size(-3);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "query heads must be a multiple of KV heads, at most ", kMaxGroup, " per KV head");
  const auto kv_type = keys[0].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, "KV must be float32 or bfloat16");
  for (int64_t r = 0; r < rows; ++r) {
    for (const at::Tensor* t : {&keys[r], &values[r]}) {
      TORCH_CHECK(t->scalar_type() == kv_type && t->device().is_cpu(), "every K and V of one dtype, on the CPU");
      TORCH_CHECK(t->dim() >= 3 && t->size(-3) == kv_heads && t->size(-1) == dim && t->stride(-1) == 1 &&
                      t->stride(-2) == dim,
                  "K and V must be [kv_heads, positions, head_dim] with each position's values contiguous");
    }
    TORCH_CHECK(keys[r].size(-2) == values[r].size(-2) && keys[r].size(-2) > 0,
                "a row's K and V must hold the same number of positions, at least one");
  }
  at::Tensor out = at::empty_like(q);
  switch (dim) {
    case 16:
      attend_rows<16>(q, keys, values, float(scale), out);
      break;
    case 32:
      attend_rows<32>(q, keys, values, float(scale), out);
      break;
    case 64:
      attend_rows<64>(q, keys, values, float(scale), out);
      break;
    case 128:
      attend_rows<128>(q, keys, values, float(scale), out);
      break;
    default:
      TORCH_CHECK(false, "head_dim ", dim, " is not built (16, 32, 64 and 128 are)");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one query token per row over each row's own KV");
}
