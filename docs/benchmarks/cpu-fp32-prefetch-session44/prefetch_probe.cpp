// inductor's fp32 micro-kernel loop (16 x 16 register block, one 16-wide vector of packed weights per k step, M query
// rows broadcast), over 540 MB of weights packed as the C++ GEMM template packs them ([N / 16][K][16]), so that every
// row of weights comes from DRAM: ms per pass at M rows, without a prefetch and with one `distance` k steps (64-byte
// rows) ahead into L1 (T0) or L2 (T1, _MM_HINT_T1 = 2) or L3 (T2).
//     g++ -O3 -march=native -fopenmp prefetch_probe.cpp -o prefetch_probe && OMP_NUM_THREADS=2 ./prefetch_probe
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <omp.h>
template <int M, int PF, int HINT=_MM_HINT_T0>
static inline void kern(const float* A, const float* B, float* C, int K, int lda) {
  __m512 acc[M];
  for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
  for (int k = 0; k < K; k++) {
    if (PF) _mm_prefetch((const char*)(B + (k + PF) * 16), (_mm_hint)HINT);
    __m512 b = _mm512_loadu_ps(B + k * 16);
#pragma GCC unroll 16
    for (int r = 0; r < M; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(A[r * lda + k]), b, acc[r]);
  }
  for (int r = 0; r < M; r++) _mm512_storeu_ps(C + r * 16, acc[r]);
}
template <int M, int PF, int H>
double run2(const float* A, const float* W, float* C, long nblocks, int K, int reps) {
  auto t = std::chrono::steady_clock::now();
  for (int rep = 0; rep < reps; rep++) {
#pragma omp parallel for schedule(static)
    for (long nb = 0; nb < nblocks; nb++) kern<M, PF, H>(A, W + nb * K * 16, C + (nb % 64) * M * 16 + omp_get_thread_num() * 64 * 16 * 16, K, K);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / reps * 1e3;
}
int main() {
  const int K = 576; const long N = 540L * 1024 * 1024 / 4 / K;
  const long nblocks = N / 16;
  std::vector<float> W(nblocks * K * 16), A(16 * K), C(2 * 64 * 16 * 16 * 16);
  for (size_t i = 0; i < W.size(); i++) W[i] = (i % 7) * 0.1f;
  for (auto& a : A) a = 0.5f;
  run2<1, 0, 3>(A.data(), W.data(), C.data(), nblocks, K, 2);
  printf("M   none  T0/32  T0/64 T0/128 T0/256  T1/64 T1/128  T2/128\n");
#define R(m, pf, h) run2<m, pf, h>(A.data(), W.data(), C.data(), nblocks, K, 5)
#define ROW(m) printf("%-2d %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f\n", m, R(m,0,3), R(m,32,3), R(m,64,3), R(m,128,3), R(m,256,3), R(m,64,2), R(m,128,2), R(m,128,1));
  for (int rep = 0; rep < 2; rep++) { ROW(1) ROW(2) ROW(3) ROW(4) ROW(6) ROW(8) ROW(12) ROW(16) }
}
