/* Each framework's gradient-reduction arithmetic (include/ddp/shard.h, ddp_grad_arith_t;
 * docs/sharding.md "Framework arithmetic"): where the division by W happens around the
 * rank-order sum. The f32 divisions are true divisions by the factor rounded to f32, as
 * PyTorch's CPU `tensor.div_(python_float)`; the multiplies are by the reciprocal computed
 * in double and rounded to f32, as `tensor.mul_(1 / W)` and DDP's reducer. */
#include <string.h>

#include "common/common.h"
#include "ddp/shard.h"

static const char *const names[] = {"ddp", "fsdp1", "fsdp2", "deepspeed", "deepspeed_allreduce"};

const char *ddp_grad_arith_name(ddp_grad_arith_t a) {
  return (size_t)a < DDP_ARRAY_LEN(names) ? names[a] : "?";
}

bool ddp_grad_arith_parse(const char *name, ddp_grad_arith_t *out) {
  DDP_REQUIRE(out);
  for (size_t i = 0; name && i < DDP_ARRAY_LEN(names); i++)
    if (!strcmp(name, names[i])) {
      *out = (ddp_grad_arith_t)i;
      return true;
    }
  return false;
}

/* FSDP1's _get_gradient_predivide_factor: 1 doubled while W % f == 0 and W / f > f. */
static double fsdp1_pre(int world) {
  int f = 1;
  while (world % f == 0 && (double)world / f > f) f *= 2;
  return (double)f;
}

void ddp_grad_arith_factors(ddp_grad_arith_t a, int world, double *pre, double *post) {
  double w = (double)world, p = 1, q = 1;
  switch (a) {
    case DDP_GRAD_ARITH_DDP:
    case DDP_GRAD_ARITH_DEEPSPEED: p = w; break;
    case DDP_GRAD_ARITH_FSDP1:
      p = fsdp1_pre(world);
      q = w / p;
      break;
    case DDP_GRAD_ARITH_FSDP2:
    case DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE: q = w; break;
  }
  if (pre) *pre = p;
  if (post) *post = q;
}

/* dst = src / d (true division) or src * fl(1/d) (mul), in dt. d == 1: a copy. */
static void scale(void *dst, const void *src, size_t n, ddp_dtype_t dt, double d, bool mul) {
  if (d == 1) {
    if (dst != src) memmove(dst, src, n * ddp_dtype_size(dt));
    return;
  }
  if (dt == DDP_F32) {
    float *o = dst, fd = (float)d, r = (float)(1.0 / d);
    const float *s = src;
    if (mul)
      for (size_t k = 0; k < n; k++) o[k] = s[k] * r;
    else
      for (size_t k = 0; k < n; k++) o[k] = s[k] / fd;
  } else {
    DDP_REQUIRE(dt == DDP_F64);
    double *o = dst, r = 1.0 / d;
    const double *s = src;
    if (mul)
      for (size_t k = 0; k < n; k++) o[k] = s[k] * r;
    else
      for (size_t k = 0; k < n; k++) o[k] = s[k] / d;
  }
}

void ddp_grad_arith_pre(ddp_grad_arith_t a, int world, bool divide_in_place, void *dst,
                        const void *src, size_t n, ddp_dtype_t dt) {
  double pre;
  ddp_grad_arith_factors(a, world, &pre, NULL);
  scale(dst, src, n, dt, pre, a == DDP_GRAD_ARITH_DDP && !divide_in_place);
}

void ddp_grad_arith_post(ddp_grad_arith_t a, int world, void *buf, size_t n, ddp_dtype_t dt) {
  double post;
  ddp_grad_arith_factors(a, world, NULL, &post);
  scale(buf, buf, n, dt, post, a == DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE);
}

/* ---------------------------------------------------------------- the comm hook --- */

typedef struct arith_state {
  ddp_grad_arith_t a;
} arith_state_t;

typedef struct arith_call {
  ddp_grad_arith_t a;
  int world;
  void *buf;
  size_t n;
  ddp_dtype_t dt;
} arith_call_t;

static ddp_status_t arith_post(void *user, ddp_comm_work_t *w) {
  arith_call_t *c = user;
  ddp_grad_arith_post(c->a, c->world, c->buf, c->n, c->dt);
  ddp_comm_work_set_result(w, c->buf, c->n, c->dt);
  return DDP_OK;
}

static ddp_status_t arith_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                               ddp_comm_work_t **out) {
  DDP_REQUIRE(state && pg && b && out);
  *out = NULL;
  if (b->dtype != DDP_F32 && b->dtype != DDP_F64) return DDP_ERR_UNSUPPORTED;
  arith_call_t *c = ddp__calloc(1, sizeof *c);
  if (!c) return DDP_ERR_NO_MEMORY;
  *c = (arith_call_t){((arith_state_t *)state)->a, ddp_pg_size(pg), b->buffer, b->numel, b->dtype};
  ddp_grad_arith_pre(c->a, c->world, true, c->buf, c->buf, c->n, c->dt);
  ddp_comm_work_t *w = NULL;
  ddp_status_t st = ddp_comm_work_create(&w);
  if (st != DDP_OK) {
    ddp__free(c);
    return st;
  }
  ddp_comm_work_on_free(w, ddp__free, c);
  ddp_work_t *pw = NULL;
  st = ddp_allreduce(pg, c->buf, c->buf, c->n, c->dt, DDP_OP_SUM, &pw);
  if (st == DDP_OK) st = ddp_comm_work_add(w, pw);
  if (st != DDP_OK) {
    ddp_comm_work_free(w);
    return st;
  }
  ddp_comm_work_then(w, arith_post, c);
  *out = w;
  return DDP_OK;
}

ddp_status_t ddp_grad_arith_hook(ddp_grad_arith_t a, ddp_comm_hook_t *out) {
  DDP_REQUIRE(out && (size_t)a < DDP_ARRAY_LEN(names));
  memset(out, 0, sizeof *out);
  arith_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return DDP_ERR_NO_MEMORY;
  s->a = a;
  out->fn = arith_hook;
  out->state = s;
  out->name = names[a];
  out->free_state = ddp__free;
  return DDP_OK;
}
