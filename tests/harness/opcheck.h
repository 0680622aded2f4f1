/* Checks of nn operations shared by tests/test_nn.c, tests/test_nn_torch.c and
 * tests/test_nn_attention.c: each op's input gradients against central finite differences
 * in f64, and each op's forward and input gradients against PyTorch 1.13 through
 * tools/torch/nn_oracle.py's `ops` command. Parent side: these assert (CMocka). */
#ifndef DDP_TEST_OPCHECK_H
#define DDP_TEST_OPCHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/nn.h"

/* What an input holds; values come from a ddp_rng_t (ddp_test_opin_fill). */
typedef enum ddp_test_in_kind {
  DDP_TEST_IN_FLOAT = 0,   /* uniform in [-1, 1), the op's dtype */
  DDP_TEST_IN_IDS = 1,     /* I64 in [0, hi) */
  DDP_TEST_IN_TARGETS = 2, /* I64 in [0, hi), element k with k % 3 == 1 set to -100 */
  DDP_TEST_IN_MASK = 3,    /* the op's dtype, 1 until a torch case's prepare hook sets it */
  DDP_TEST_IN_PAD = 4      /* I64 [B, T] padding mask, 1 = attend: row b % 3 == 1 pads its
                            * last two positions, row b % 3 == 2 its first two */
} ddp_test_in_kind_t;

typedef struct ddp_test_opin {
  int ndim;
  int64_t shape[4];
  int kind;   /* ddp_test_in_kind_t */
  int64_t hi; /* IDS and TARGETS: the exclusive upper bound */
  bool rg;    /* requires grad (FLOAT only) */
} ddp_test_opin_t;

#define DDP_TEST_OP_MAX_IN 7 /* Llama's gated MLP with mlp_bias: x, 3 weights, 3 biases */

/* Element count of an input. */
int64_t ddp_test_opin_numel(const ddp_test_opin_t *in);
/* Fills data (numel values, ids as integral doubles) for in from rng. */
void ddp_test_opin_fill(const ddp_test_opin_t *in, ddp_rng_t *rng, double *data);
/* Whether the input is integer-valued (I64). */
bool ddp_test_opin_is_int(const ddp_test_opin_t *in);

/* ---------------------------------------------------------------- finite differences */

typedef ddp_status_t (*ddp_test_build_fn)(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **out);

typedef struct ddp_test_gcase {
  const char *name;
  int nin;
  ddp_test_opin_t in[DDP_TEST_OP_MAX_IN];
  ddp_test_build_fn fn; /* the op under test, on f64 inputs */
} ddp_test_gcase_t;

/* For each case: loss = sum(fn(inputs) * r) with a fixed random r, in f64, the context's
 * RNG set to (7, 0, 1) before every evaluation (so dropout draws repeat). Every input with
 * rg gets its analytic gradient compared with central differences (h = 1e-6): the test
 * fails, naming the case, the input and both numbers, unless max|a - n| / max|n| < tol and
 * max|n| > 0 (the gradient is not trivially zero). Returns the largest relative error. */
double ddp_test_gradcheck(const ddp_test_gcase_t *cases, size_t n, double tol);

/* ---------------------------------------------------------------- against PyTorch -- */

typedef struct ddp_test_tcase {
  const char *name;
  const char *op;    /* the op's name in nn_oracle.py's run_op */
  const char *attrs; /* a JSON object's text, passed to run_op */
  int nin;
  ddp_test_opin_t in[DDP_TEST_OP_MAX_IN];
} ddp_test_tcase_t;

typedef struct ddp_test_torch_ops {
  const ddp_test_tcase_t *cases;
  size_t n;
  /* Runs case tc in libddp on in (vars of dtype dt, ids I64), setting *y. The context's RNG
   * was set to (3, 0, 0) just before. */
  ddp_status_t (*run)(void *user, ddp_ctx_t *c, const ddp_test_tcase_t *tc, ddp_var_t **in,
                      ddp_var_t **y);
  /* Optional: called after a first forward whose output is y, before the case's files are
   * written: sets MASK inputs in data and writes extra files into dir. It may use c (which
   * it leaves free for the driver to reset). */
  void (*prepare)(void *user, ddp_ctx_t *c, const ddp_test_tcase_t *tc, ddp_dtype_t dt,
                  double **data, const int64_t *numel, const ddp_var_t *y, const char *dir);
  /* Optional: called after the forward and gradients matched, for more checks on dir. */
  void (*check)(void *user, const ddp_test_tcase_t *tc, ddp_dtype_t dt, const char *dir);
  void *user;
  /* Optional, NULL-terminated: ops whose f32 results must equal torch's bit for bit (they
   * reproduce torch's float arithmetic, as batch norm does), not only within tol. */
  const char *const *f32_exact_ops;
} ddp_test_torch_ops_t;

/* The largest errors of one ddp_test_ops_vs_torch run, and the cases they came from. */
typedef struct ddp_test_torch_err {
  double forward, grad;
  const char *forward_case, *grad_case;
} ddp_test_torch_err_t;

/* Whether /usr/bin/python3 imports torch and numpy (else the torch tests skip). */
bool ddp_test_have_torch(void);

/* Writes every case into root/<NN>_<name>/, root being scratch/ops_f32 or ops_f64 (made
 * here; it must not exist yet) (case.json, inK.bin, gout.bin with a random
 * output gradient), runs `nn_oracle.py ops root`, then runs each case in libddp with dtype
 * dt and that output gradient. The forward and every rg input's gradient must match:
 * max|libddp - torch| / max(max|torch|, 1e-3) < tol, else the test fails naming the case,
 * the tensor and both values at the worst element. Skips
 * the test (cmocka skip) when torch is absent. err (may be NULL) gets the largest errors. */
void ddp_test_ops_vs_torch(const ddp_test_torch_ops_t *o, const char *scratch, ddp_dtype_t dt,
                           double tol, ddp_test_torch_err_t *err);

/* Raw file helpers of the driver: write, and read exactly n bytes (fails otherwise). */
void ddp_test_write_bin(const char *dir, const char *name, const void *data, size_t n);
void ddp_test_read_bin(const char *dir, const char *name, void *data, size_t n);

/* A new leaf of ctx (F32 or F64, shape [ndim]) holding U(-1, 1) draws from seed (stream 3)
 * in element order; fails the test when ddp_var_new does. */
ddp_var_t *ddp_test_rand_var(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape,
                             uint64_t seed, bool requires_grad);

#endif /* DDP_TEST_OPCHECK_H */
