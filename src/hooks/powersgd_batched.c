/* batched_powerSGD_hook (spec §7.7): the whole bucket as one s x s matrix (s =
 * ceil(sqrt(numel)), zero-padded), compressed to rank r with 2 allreduces per bucket (P, Q).
 * The state and the steps it shares with powerSGD_hook are in powersgd_state.c and
 * powersgd.c. */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "powersgd_internal.h"

typedef struct bpsgd_call {
  psgd_call_t c;
  size_t side, rank;
  /* When the bucket arrives in another order than its memories' layout: per parameter,
   * its offset now (map[3k]), in the memories' layout (map[3k+1]) and its length. */
  size_t *map;
  size_t nmap;
  float *in_old; /* the bucket in the memories' layout */
  float *out;    /* the result back in the current layout */
} bpsgd_call_t;

static ddp_status_t bpsgd_finish(void *user, ddp_comm_work_t *w) {
  bpsgd_call_t *k = user;
  psgd_call_t *c = &k->c;
  psgd_mem_t *mem = c->mem = &c->s->mem[c->index]; /* the array may have grown */
  float world = (float)ddp_pg_size(c->pg);
  size_t s2 = k->side * k->side;
  for (size_t i = 0; i < mem->nq; i++) mem->q[i] /= world;
  DDP_CHECK(ddp_gemm(DDP_F32, false, true, (int64_t)k->side, (int64_t)k->side, (int64_t)k->rank,
                     1.0, mem->p, (int64_t)k->rank, mem->q, (int64_t)k->rank, 0.0, c->in,
                     (int64_t)k->side));
  if (c->s->o.use_error_feedback)
    for (size_t i = 0; i < s2; i++) mem->error[i] = c->cp[i] - c->in[i];
  if (!c->s->o.warm_start) ddp__psgd_mem_clear(mem);
  ddp__psgd_maybe_increase_iter(c->s, c->is_last);
  if (k->nmap) {
    k->out = ddp__malloc((c->numel + 1) * sizeof(float));
    if (!k->out) return DDP_ERR_NO_MEMORY;
    for (size_t j = 0; j < k->nmap; j++)
      memcpy(k->out + k->map[3 * j], c->in + k->map[3 * j + 1], k->map[3 * j + 2] * sizeof(float));
    ddp_comm_work_set_result(w, k->out, c->numel, DDP_F32);
    return DDP_OK;
  }
  ddp_comm_work_set_result(w, c->in, c->numel, DDP_F32);
  return DDP_OK;
}

/* batched_powerSGD_hook compresses the bucket as one matrix, so the order of its tensors
 * is part of the arithmetic. When the reducer hands a bucket over in another order than
 * the one its memories were built in (the step after a resume, before the reducer's
 * rebuild), the bucket is rearranged into the memories' order for the computation and the
 * result rearranged back, which gives bitwise what the old order gives. A bucket with
 * other tensors drops its memories (they restart as on first use). */
static ddp_status_t batched_layout(ddp_powersgd_state_t *s, psgd_mem_t *mem,
                                   const ddp_grad_bucket_t *b, bpsgd_call_t *k) {
  size_t cnt = b->nparams;
  size_t *lay = ddp__psgd_bucket_layout(b);
  if (!lay) return DDP_ERR_NO_MEMORY;
  bool fresh = mem->nlay == 0 || (!mem->error && !mem->has_mem);
  if (!fresh && mem->nlay == cnt && !memcmp(mem->lay, lay, 4 * cnt * sizeof *lay)) {
    ddp__free(lay);
    return DDP_OK;
  }
  bool perm = !fresh && mem->nlay == cnt;
  size_t *map = perm ? ddp__malloc((3 * cnt + 1) * sizeof *map) : NULL;
  if (perm && !map) {
    ddp__free(lay);
    return DDP_ERR_NO_MEMORY;
  }
  size_t total = 0;
  for (size_t j = 0; perm && j < cnt; j++) {
    perm = false;
    for (size_t i = 0; i < cnt && !perm; i++) {
      if (mem->lay[4 * i] != lay[4 * j] || mem->lay[4 * i + 2] != lay[4 * j + 2]) continue;
      map[3 * j] = lay[4 * j + 1];
      map[3 * j + 1] = mem->lay[4 * i + 1];
      map[3 * j + 2] = lay[4 * j + 2];
      perm = map[3 * j] + map[3 * j + 2] <= b->numel && map[3 * j + 1] + map[3 * j + 2] <= b->numel;
    }
    total += lay[4 * j + 2];
  }
  if (perm && total == b->numel) {
    ddp__free(lay);
    k->map = map;
    k->nmap = cnt;
    return DDP_OK;
  }
  ddp__free(map);
  if (!fresh) {
    ddp__psgd_mem_restart(mem, s->rank, b->index);
  }
  ddp__free(mem->lay);
  mem->lay = lay;
  mem->nlay = cnt;
  return DDP_OK;
}

static ddp_status_t bpsgd_after_p(void *user, ddp_comm_work_t *w) {
  bpsgd_call_t *k = user;
  psgd_call_t *c = &k->c;
  psgd_mem_t *mem = c->mem = &c->s->mem[c->index]; /* the array may have grown */
  DDP_CHECK(
      ddp__psgd_orthogonalize(mem->p, k->side, k->rank, c->s->o.orthogonalization_epsilon, c->low));
  DDP_CHECK(ddp_gemm(DDP_F32, true, false, (int64_t)k->side, (int64_t)k->rank, (int64_t)k->side,
                     1.0, c->in, (int64_t)k->side, mem->p, (int64_t)k->rank, 0.0, mem->q,
                     (int64_t)k->rank));
  DDP_CHECK(ddp__psgd_launch(c->s, c->pg, w, mem->q, mem->nq));
  ddp_comm_work_then(w, bpsgd_finish, k);
  return DDP_OK;
}

static void bcall_free(void *user) {
  bpsgd_call_t *k = user;
  psgd_call_t *c = &k->c;
  if (c->own_in) ddp__free(c->in);
  ddp__free(c->cp);
  ddp__free(k->map);
  ddp__free(k->in_old);
  ddp__free(k->out);
  ddp__free(k);
}

ddp_status_t ddp_batched_powersgd_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                       ddp_comm_work_t **out) {
  ddp_powersgd_state_t *s = state;
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && pg && b && out);
  *out = NULL;
  if (b->index == 0) s->bytes_step = 0;
  if (s->iter < s->o.start_powerSGD_iter) return ddp__psgd_warmup(s, pg, b, out);
  if (b->dtype != DDP_F32 && b->dtype != DDP_F16 && b->dtype != DDP_BF16)
    return DDP_ERR_UNSUPPORTED;
  size_t side = (size_t)ceil(sqrt((double)b->numel));
  while (side * side < b->numel) side++;
  size_t rank = (size_t)s->o.matrix_approximation_rank;
  if (rank > side && rank > 2) return DDP_ERR_INVALID_ARGUMENT;
  bpsgd_call_t *k = ddp__calloc(1, sizeof *k);
  if (!k) return DDP_ERR_NO_MEMORY;
  psgd_call_t *c = &k->c;
  c->s = s;
  c->pg = pg;
  c->index = b->index;
  c->is_last = b->is_last;
  c->low = b->dtype != DDP_F32;
  c->numel = b->numel;
  k->side = side;
  k->rank = rank;
  ddp_comm_work_t *w = NULL;
  ddp_status_t st = ddp_comm_work_create(&w);
  if (st != DDP_OK) {
    ddp__free(k);
    return st;
  }
  ddp_comm_work_on_free(w, bcall_free, k);
  c->mem = ddp__psgd_get_mem(s, b->index);
  if (!c->mem) {
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  DDP_CHECK_GOTO(batched_layout(s, c->mem, b, k), st, fail);
  ddp_grad_bucket_t in = *b;
  if (k->nmap) {
    k->in_old = ddp__malloc((b->numel + 1) * sizeof(float));
    if (!k->in_old) {
      st = DDP_ERR_NO_MEMORY;
      goto fail;
    }
    for (size_t j = 0; j < k->nmap; j++)
      for (size_t i = 0; i < k->map[3 * j + 2]; i++)
        k->in_old[k->map[3 * j + 1] + i] = ddp__hk_load(b->buffer, b->dtype, k->map[3 * j] + i);
    in.buffer = k->in_old;
    in.dtype = DDP_F32;
  }
  /* The padded s x s input (zeros past numel); error feedback runs on the padded length. */
  DDP_CHECK_GOTO(ddp__psgd_prepare_input(c, &in, side * side), st, fail);
  s->total_before += (int64_t)b->numel;
  s->total_after += (int64_t)(2 * side * rank);
  ddp__psgd_maybe_log_stats(s, b->is_last);
  bool need_rand;
  DDP_CHECK_GOTO(ddp__psgd_prepare_memory(c, side * rank, side * rank, &need_rand), st, fail);
  psgd_mem_t *mem = c->mem;
  if (need_rand) ddp__psgd_fill_normal(s, b->index, mem->q, mem->nq);
  DDP_CHECK_GOTO(ddp__psgd_orthogonalize(mem->q, side, rank, s->o.orthogonalization_epsilon,
                                         c->low),
                 st, fail);
  DDP_CHECK_GOTO(ddp_gemm(DDP_F32, false, false, (int64_t)side, (int64_t)rank, (int64_t)side, 1.0,
                          c->in, (int64_t)side, mem->q, (int64_t)rank, 0.0, mem->p, (int64_t)rank),
                 st, fail);
  DDP_CHECK_GOTO(ddp__psgd_launch(s, pg, w, mem->p, mem->np), st, fail);
  ddp_comm_work_then(w, bpsgd_after_p, k);
  *out = w;
  return DDP_OK;
fail:
  ddp_comm_work_free(w);
  return st;
}
