/* Helpers shared by the files that implement operations (ops.c, ops_matmul.c, ops_shape.c,
 * ops_attention.c, ops_lm_loss.c): the float/double dispatch, argument checks, output
 * creation and the gemm call with its error message. Private to src/nn. */
#ifndef DDP_NN_OPS_COMMON_H
#define DDP_NN_OPS_COMMON_H

#include "nn/nn_internal.h"

/* Runs the block with T bound to float (F32) or double (F64). */
#define DISPATCH(dt, ...)  \
  do {                     \
    if ((dt) == DDP_F32) { \
      typedef float T;     \
      __VA_ARGS__          \
    } else {               \
      typedef double T;    \
      __VA_ARGS__          \
    }                      \
  } while (0)

#define OOM(c, op) ddp__ctx_error((c), DDP_ERR_NO_MEMORY, "%s: arena exhausted", (op))

static inline bool is_float(ddp_dtype_t dt) { return dt == DDP_F32 || dt == DDP_F64; }

static inline ddp_status_t check_float(ddp_ctx_t *c, const char *op, const ddp_var_t *v) {
  DDP_REQUIRE(v);
  if (!is_float(v->value.dtype))
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "%s: expected F32 or F64, got %s", op,
                          ddp_dtype_name(v->value.dtype));
  return DDP_OK;
}

static inline ddp_status_t check_same(ddp_ctx_t *c, const char *op, const ddp_var_t *a,
                                      const ddp_var_t *b) {
  DDP_CHECK(check_float(c, op, a));
  DDP_CHECK(check_float(c, op, b));
  if (a->value.dtype != b->value.dtype || !ddp_tensor_same_shape(&a->value, &b->value)) {
    char sa[128], sb[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "%s: operands differ: %s vs %s", op,
                          ddp_tensor_describe(&a->value, sa, sizeof sa),
                          ddp_tensor_describe(&b->value, sb, sizeof sb));
  }
  return DDP_OK;
}

static inline int64_t last_dim(const ddp_var_t *v) {
  return v->value.ndim ? v->value.shape[v->value.ndim - 1] : 1;
}

/* Output var (zeroed) with the given shape and, when needed, its node. With raw the value
 * storage is left unwritten: only for an op that then writes every output element. */
static inline ddp_status_t make_out_as(ddp_ctx_t *c, const char *op, ddp__backward_fn bw,
                                       ddp_dtype_t dt, int ndim, const int64_t *shape, size_t nin,
                                       ddp_var_t *const *ins, bool raw, ddp_var_t **y,
                                       ddp_node_t **node) {
  *node = NULL;
  ddp_var_t *v = raw ? ddp__var_alloc_raw(c, dt, ndim, shape) : ddp__var_alloc(c, dt, ndim, shape);
  if (!v) return OOM(c, op);
  if (ddp__needs_grad(c, nin, ins)) {
    *node = ddp__node_new(c, op, bw, v, nin, ins);
    if (!*node) return OOM(c, op);
  }
  *y = v;
  return DDP_OK;
}

static inline ddp_status_t make_out(ddp_ctx_t *c, const char *op, ddp__backward_fn bw,
                                    ddp_dtype_t dt, int ndim, const int64_t *shape, size_t nin,
                                    ddp_var_t *const *ins, ddp_var_t **y, ddp_node_t **node) {
  return make_out_as(c, op, bw, dt, ndim, shape, nin, ins, false, y, node);
}

/* make_out for an op that writes every element of its output. */
static inline ddp_status_t make_out_raw(ddp_ctx_t *c, const char *op, ddp__backward_fn bw,
                                        ddp_dtype_t dt, int ndim, const int64_t *shape, size_t nin,
                                        ddp_var_t *const *ins, ddp_var_t **y, ddp_node_t **node) {
  return make_out_as(c, op, bw, dt, ndim, shape, nin, ins, true, y, node);
}

/* C = alpha * op(A) @ op(B) + beta * C through ddp_gemm, with the op named on failure. */
static inline ddp_status_t gemm_scaled(ddp_ctx_t *c, const char *op, ddp_dtype_t dt, bool ta,
                                       bool tb, int64_t m, int64_t n, int64_t k, double alpha,
                                       const void *a, int64_t lda, const void *b, int64_t ldb,
                                       double beta, void *cc, int64_t ldc) {
  if (m == 0 || n == 0) return DDP_OK;
  ddp_status_t st = ddp_gemm(dt, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, cc, ldc);
  if (st != DDP_OK)
    return ddp__ctx_error(c, st, "%s: gemm %lldx%lldx%lld failed", op, (long long)m, (long long)n,
                          (long long)k);
  return DDP_OK;
}

static inline ddp_status_t gemm(ddp_ctx_t *c, const char *op, ddp_dtype_t dt, bool ta, bool tb,
                                int64_t m, int64_t n, int64_t k, const void *a, int64_t lda,
                                const void *b, int64_t ldb, double beta, void *cc, int64_t ldc) {
  return gemm_scaled(c, op, dt, ta, tb, m, n, k, 1.0, a, lda, b, ldb, beta, cc, ldc);
}

#endif /* DDP_NN_OPS_COMMON_H */
