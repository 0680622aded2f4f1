/* The row kernel built on ddp__vexpf that attention's softmax and the causal-LM loss share
 * (ops_vexp.h). */
#include "nn/ops_vexp.h"

DDP__VEC_KERNEL double ddp__sum_expf(const float *row, int64_t n, float mx, float *e) {
  for (int64_t j = 0; j < n; j++) e[j] = ddp__vexpf(row[j] - mx);
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    a0 += e[j];
    a1 += e[j + 1];
    a2 += e[j + 2];
    a3 += e[j + 3];
  }
  for (; j < n; j++) a0 += e[j];
  return (a0 + a1) + (a2 + a3);
}
