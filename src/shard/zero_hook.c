/* ZeRO-1 overlapped with DDP (include/ddp/shard.h): PyTorch 1.13's hook_with_zero_step and
 * hook_with_zero_step_interleaved (torch/distributed/algorithms/ddp_comm_hooks/
 * ddp_zero_hook.py) with ZeroRedundancyOptimizer(overlap_with_ddp=True)'s delayed
 * initialisation, bucket partition (_bucket_assignments_per_rank) and per-assignment flat
 * parameter tensors (_build_ddp_param_buckets).
 *
 * Status as _OverlapStatus: UNINITIALIZED until the caller says DDP has rebuilt its
 * buckets; DDP_HAS_REBUILT_BUCKETS while the buckets' parameters are recorded; INITIALIZED
 * from bucket 0 of the iteration after that, when the partition is made and the optimizers
 * created. Each rank's optimizers hold its parameters of every assignment it owns, one per
 * optimizer group; a partial step over one bucket presents only that bucket's gradients
 * (views into the reduced result) and leaves the others None, as the functional optimizer's
 * step(gradients) with None entries does. */
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "ddp/shard.h"

#define OVL_MAGIC 0x5a4f564cu /* "ZOVL" */

enum { UNINITIALIZED, DDP_HAS_REBUILT_BUCKETS, INITIALIZED };

typedef struct assignment {
  size_t bucket, first, count; /* parameters first .. first + count - 1 of the bucket */
  int rank;
  unsigned char *tensor; /* the flat parameters (into ovl->store) */
  size_t numel;
} assignment_t;

typedef struct bucket_info {
  size_t n;     /* parameters */
  size_t *idx;  /* [2n] global parameter index of bucket parameter k, then its gradient's
                 * element offset in the bucket (idx[n + k]) */
  size_t numel; /* their total */
} bucket_info_t;

typedef struct call call_t; /* one interleaved bucket's continuation */

struct ddp_zero_overlap {
  uint32_t magic;
  ddp_pg_t *pg;
  int rank, world;
  ddp_zero_overlap_options_t opts;
  ddp_comm_hook_t inner;
  char name[128];
  size_t n, ngroups;
  ddp_optim_param_t *params; /* [n] the caller's pairs */
  int *group;                /* [n] */
  ddp_optim_options_t gopts[DDP_ZERO_MAX_GROUPS];
  ddp_dtype_t dt;
  size_t esz;
  int status;
  size_t nb;
  bucket_info_t *bk; /* [nb] recorded in DDP_HAS_REBUILT_BUCKETS */
  size_t nasg;
  assignment_t *asg; /* [nasg] */
  int *owner;        /* [n] */
  unsigned char *store;
  void **home;     /* [n] former parameter storage */
  ddp_tensor_t *g; /* [n] gradient headers the optimizers read (data NULL: None) */
  ddp_optim_t *opt[DDP_ZERO_MAX_GROUPS];
  double lr;
  int64_t updates;
  /* per iteration */
  ddp_comm_work_t **fut; /* [nb] STEP: the owned buckets' works */
  size_t seen;
  ddp_work_t **bcast; /* [nasg] */
  size_t nbcast;
};

/* ---------------------------------------------------------------- names ----------- */

static const char *const kinds[] = {"hook_with_zero_step", "hook_with_zero_step_interleaved"};

const char *ddp_zero_hook_kind_name(ddp_zero_hook_kind_t k) {
  return (size_t)k < DDP_ARRAY_LEN(kinds) ? kinds[k] : "?";
}

bool ddp_zero_hook_kind_parse(const char *name, ddp_zero_hook_kind_t *out) {
  DDP_REQUIRE(name && out);
  for (size_t k = 0; k < DDP_ARRAY_LEN(kinds); k++)
    if (!strcmp(name, kinds[k])) {
      *out = (ddp_zero_hook_kind_t)k;
      return true;
    }
  return false;
}

/* ---------------------------------------------------------------- default inner --- */

/* DDP's own reduction as a hook: the reducer's divide (x * fl(1/W), or / W in place), then
 * an allreduce SUM in place; resolves to the bucket buffer. */
static ddp_status_t ddp_arith_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                   ddp_comm_work_t **out) {
  const bool *in_place = state;
  *out = NULL;
  if (b->dtype != DDP_F32 && b->dtype != DDP_F64) return DDP_ERR_UNSUPPORTED;
  ddp_grad_arith_pre(DDP_GRAD_ARITH_DDP, ddp_pg_size(pg), *in_place, b->buffer, b->buffer, b->numel,
                     b->dtype);
  ddp_comm_work_t *w = NULL;
  DDP_CHECK(ddp_comm_work_create(&w));
  ddp_work_t *pw = NULL;
  ddp_status_t st = ddp_allreduce(pg, b->buffer, b->buffer, b->numel, b->dtype, DDP_OP_SUM, &pw);
  if (st == DDP_OK) st = ddp_comm_work_add(w, pw);
  if (st != DDP_OK) {
    ddp_comm_work_free(w);
    return st;
  }
  ddp_comm_work_set_result(w, b->buffer, b->numel, b->dtype);
  *out = w;
  return DDP_OK;
}

/* ---------------------------------------------------------------- create ---------- */

ddp_status_t ddp_zero_overlap_create(ddp_pg_t *pg, const ddp_zero_overlap_options_t *opts,
                                     const ddp_zero_group_t *groups, size_t ngroups,
                                     const ddp_comm_hook_t *inner, ddp_zero_overlap_t **out,
                                     ddp_error_t *err) {
  DDP_REQUIRE(pg && opts && out && (groups || ngroups == 0));
  DDP_REQUIRE(opts->struct_size >= sizeof(ddp_zero_overlap_options_t));
  DDP_REQUIRE(opts->has_rebuilt_buckets);
  *out = NULL;
  int rank = ddp_pg_rank(pg);
  ddp_zero_overlap_t *z = ddp__calloc(1, sizeof *z);
  if (!z) {
    if (inner && inner->free_state) inner->free_state(inner->state);
    return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "zero overlap: out of memory");
  }
  *z = (ddp_zero_overlap_t){.magic = OVL_MAGIC,
                            .pg = pg,
                            .rank = rank,
                            .world = ddp_pg_size(pg),
                            .opts = *opts,
                            .ngroups = ngroups,
                            .dt = DDP_F32,
                            .lr = -1};
  z->opts.user = opts->user;
  if (inner) {
    z->inner = *inner;
  } else {
    z->inner.fn = ddp_arith_hook;
    z->inner.state = &z->opts.divide_in_place;
    z->inner.name = "allreduce";
  }
  snprintf(z->name, sizeof z->name, "%s(%s)", ddp_zero_hook_kind_name(opts->kind),
           z->inner.name ? z->inner.name : "comm_hook");
  z->inner.name = NULL; /* the caller's string: not kept */
  ddp_status_t st = DDP_OK;
  if ((size_t)opts->kind >= DDP_ARRAY_LEN(kinds))
    st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                    "zero overlap: hook kind %d is not hook_with_zero_step (0) or "
                    "hook_with_zero_step_interleaved (1)",
                    (int)opts->kind);
  else if (ngroups > DDP_ZERO_MAX_GROUPS)
    st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                    "zero overlap: %zu parameter groups; at most %d", ngroups, DDP_ZERO_MAX_GROUPS);
  if (st != DDP_OK) goto fail;
  for (size_t g = 0; g < ngroups; g++) z->n += groups[g].n;
  size_t n1 = z->n ? z->n : 1;
  z->params = ddp__calloc(n1, sizeof *z->params);
  z->group = ddp__calloc(n1, sizeof *z->group);
  z->owner = ddp__calloc(n1, sizeof *z->owner);
  z->home = ddp__calloc(n1, sizeof *z->home);
  z->g = ddp__calloc(n1, sizeof *z->g);
  if (!z->params || !z->group || !z->owner || !z->home || !z->g) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "zero overlap: out of memory (%zu parameters)",
                    z->n);
    goto fail;
  }
  for (size_t g = 0, i = 0; g < ngroups; g++) {
    z->gopts[g] = groups[g].opts;
    for (size_t k = 0; k < groups[g].n; k++, i++) {
      z->params[i] = groups[g].params[k];
      z->group[i] = (int)g;
      z->owner[i] = -1;
      const ddp_tensor_t *p = z->params[i].param;
      DDP_REQUIRE(p && z->params[i].grad);
      if ((p->dtype != DDP_F32 && p->dtype != DDP_F64) || (i > 0 && p->dtype != z->dt)) {
        st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                        "zero overlap: parameter %zu is %s; the parameters must be all f32 or "
                        "all f64",
                        i, ddp_dtype_name(p->dtype));
        goto fail;
      }
      z->dt = p->dtype;
    }
  }
  z->esz = ddp_dtype_size(z->dt);
  *out = z;
  return DDP_OK;
fail:
  ddp_zero_overlap_destroy(z);
  return st;
}

static void free_buckets(ddp_zero_overlap_t *z) {
  for (size_t b = 0; z->bk && b < z->nb; b++) ddp__free(z->bk[b].idx);
  ddp__free(z->bk);
  z->bk = NULL;
  z->nb = 0;
}

void ddp_zero_overlap_destroy(ddp_zero_overlap_t *z) {
  if (!z) return;
  DDP_REQUIRE(z->magic == OVL_MAGIC);
  for (size_t i = 0; z->home && i < z->n; i++) {
    if (!z->home[i]) continue;
    ddp_tensor_t *p = z->params[i].param;
    memcpy(z->home[i], p->data, (size_t)p->numel * z->esz);
    p->data = z->home[i];
  }
  for (size_t k = 0; z->bcast && k < z->nbcast; k++) ddp_work_wait_free(z->bcast[k]);
  for (size_t g = 0; g < z->ngroups; g++) ddp_optim_destroy(z->opt[g]);
  if (z->inner.free_state) z->inner.free_state(z->inner.state);
  free_buckets(z);
  ddp__free(z->asg);
  ddp__free(z->store);
  ddp__free(z->params);
  ddp__free(z->group);
  ddp__free(z->owner);
  ddp__free(z->home);
  ddp__free(z->g);
  ddp__free(z->fut);
  ddp__free(z->bcast);
  z->magic = 0;
  ddp__free(z);
}

/* ---------------------------------------------------------------- setup ----------- */

/* _save_ddp_bucket_info: bucket b's parameters as global indices. */
static ddp_status_t save_bucket(ddp_zero_overlap_t *z, const ddp_grad_bucket_t *b, char *msg,
                                size_t cap) {
  if (b->index != z->nb) {
    snprintf(msg, cap,
             "zero overlap: bucket %zu recorded after %zu buckets (buckets must come "
             "in index order)",
             b->index, z->nb);
    return DDP_ERR_INTERNAL;
  }
  bucket_info_t *nbk = ddp__malloc((z->nb + 1) * sizeof *nbk);
  size_t *idx = ddp__calloc(b->nparams ? 2 * b->nparams : 1, sizeof *idx);
  if (!nbk || !idx) {
    ddp__free(nbk);
    ddp__free(idx);
    snprintf(msg, cap, "zero overlap: out of memory");
    return DDP_ERR_NO_MEMORY;
  }
  if (z->nb) memcpy(nbk, z->bk, z->nb * sizeof *nbk);
  ddp__free(z->bk);
  z->bk = nbk;
  bucket_info_t *bi = &z->bk[z->nb++];
  *bi = (bucket_info_t){b->nparams, idx, 0};
  for (size_t k = 0; k < b->nparams; k++) {
    const ddp_param_t *p = b->params[k];
    size_t i = 0;
    while (i < z->n && z->params[i].param != &p->value) i++;
    if (i == z->n) {
      snprintf(msg, cap,
               "zero overlap: parameter '%s' of DDP bucket %zu is in none of the optimizer's "
               "groups",
               p->name, b->index);
      return DDP_ERR_INVALID_ARGUMENT;
    }
    idx[k] = i;
    idx[b->nparams + k] = b->offsets[k];
    bi->numel += (size_t)p->value.numel;
  }
  return DDP_OK;
}

static ddp_status_t add_assignment(ddp_zero_overlap_t *z, size_t b, size_t first, size_t count,
                                   int r) {
  assignment_t *a = &z->asg[z->nasg++];
  *a = (assignment_t){.bucket = b, .first = first, .count = count, .rank = r};
  for (size_t k = first; k < first + count; k++) {
    size_t i = z->bk[b].idx[k];
    if (z->owner[i] >= 0) return DDP_ERR_INVALID_ARGUMENT; /* a parameter in two buckets */
    z->owner[i] = r;
    a->numel += (size_t)z->params[i].param->numel;
  }
  return DDP_OK;
}

/* _get_min_index with the ranks already holding part of bucket b disallowed. */
static int min_rank(const ddp_zero_overlap_t *z, const size_t *load, size_t b) {
  int best = -1;
  for (int r = 0; r < z->world; r++) {
    bool taken = false;
    for (size_t k = 0; k < z->nasg && !taken; k++)
      taken = z->asg[k].bucket == b && z->asg[k].rank == r;
    if (!taken && (best < 0 || load[r] < load[best])) best = r;
  }
  return best;
}

/* _bucket_assignments_per_rank with shard_buckets: buckets by increasing size (stable),
 * each cut before the parameter that would bring the run to total / W (never empty). */
static ddp_status_t shard_buckets(ddp_zero_overlap_t *z, char *msg, size_t cap) {
  size_t *ord = ddp__calloc(z->nb, sizeof *ord),
         *load = ddp__calloc((size_t)z->world, sizeof *load);
  ddp_status_t st = ord && load ? DDP_OK : DDP_ERR_NO_MEMORY;
  double total = 0;
  for (size_t b = 0; st == DDP_OK && b < z->nb; b++) {
    total += (double)z->bk[b].numel;
    size_t j = b;
    while (j > 0 && z->bk[ord[j - 1]].numel > z->bk[b].numel) {
      ord[j] = ord[j - 1];
      j--;
    }
    ord[j] = b;
  }
  double threshold = total / (double)z->world;
  for (size_t o = 0; st == DDP_OK && o < z->nb; o++) {
    size_t b = ord[o], first = 0, size = 0;
    for (size_t k = 0; st == DDP_OK && k < z->bk[b].n; k++) {
      size_t numel = (size_t)z->params[z->bk[b].idx[k]].param->numel;
      if ((double)(size + numel) >= threshold && k > first) {
        int r = min_rank(z, load, b);
        if (r < 0)
          snprintf(msg, cap,
                   "zero overlap: shard_buckets cut DDP bucket %zu (%zu elements) into more "
                   "than %d runs below total / W = %.0f elements, one per rank (PyTorch: \"All "
                   "indices "
                   "are disallowed\"); use shard_buckets false or smaller buckets",
                   b, z->bk[b].numel, z->world, threshold);
        st = r < 0 ? DDP_ERR_INVALID_USAGE : add_assignment(z, b, first, k - first, r);
        if (r >= 0) load[r] += size;
        first = k;
        size = 0;
      }
      size += numel;
    }
    int r = st == DDP_OK ? min_rank(z, load, b) : 0;
    if (st == DDP_OK && r < 0)
      snprintf(msg, cap,
               "zero overlap: shard_buckets cut DDP bucket %zu (%zu elements) into more than "
               "%d runs below total / W = %.0f elements, one per rank (PyTorch: \"All indices are "
               "disallowed\"); use shard_buckets false or smaller buckets",
               b, z->bk[b].numel, z->world, threshold);
    if (st == DDP_OK)
      st = r < 0 ? DDP_ERR_INVALID_USAGE : add_assignment(z, b, first, z->bk[b].n - first, r);
    if (r >= 0) load[r] += size;
  }
  ddp__free(ord);
  ddp__free(load);
  return st;
}

/* The optimizers of this rank: per group its owned parameters, in the order of the
 * assignments (params_per_rank), gradients read through z->g (None until a step). */
static ddp_status_t make_optimizers(ddp_zero_overlap_t *z, ddp_error_t *err) {
  ddp_optim_param_t *mine = ddp__calloc(z->n ? z->n : 1, sizeof *mine);
  if (!mine) return ddp__error(err, z->rank, DDP_ERR_NO_MEMORY, "zero overlap: out of memory");
  ddp_status_t st = DDP_OK;
  for (size_t g = 0; st == DDP_OK && g < z->ngroups; g++) {
    size_t m = 0;
    for (size_t a = 0; a < z->nasg; a++) {
      if (z->asg[a].rank != z->rank) continue;
      for (size_t k = z->asg[a].first; k < z->asg[a].first + z->asg[a].count; k++) {
        size_t i = z->bk[z->asg[a].bucket].idx[k];
        if (z->group[i] == (int)g) mine[m++] = (ddp_optim_param_t){z->params[i].param, &z->g[i]};
      }
    }
    st = ddp_optim_create(&z->gopts[g], mine, m, &z->opt[g], err);
    if (st == DDP_OK && z->lr >= 0) ddp_optim_set_lr(z->opt[g], z->lr);
  }
  ddp__free(mine);
  return st;
}

/* _init_zero_for_overlap: the partition, the flat tensors (the parameters become views
 * into them, their values copied), the optimizers. */
static ddp_status_t init_overlap(ddp_zero_overlap_t *z, char *msg, size_t cap) {
  size_t maxasg = z->opts.shard_buckets ? z->n + z->nb * (size_t)z->world : z->nb;
  z->asg = ddp__calloc(maxasg ? maxasg : 1, sizeof *z->asg);
  z->fut = ddp__calloc(z->nb ? z->nb : 1, sizeof *z->fut);
  z->bcast = ddp__calloc(maxasg ? maxasg : 1, sizeof *z->bcast);
  size_t total = 0;
  for (size_t b = 0; b < z->nb; b++) total += z->bk[b].numel;
  z->store = ddp__calloc(total ? total : 1, z->esz);
  if (!z->asg || !z->fut || !z->bcast || !z->store) {
    snprintf(msg, cap, "zero overlap: out of memory for %zu flat parameter elements", total);
    return DDP_ERR_NO_MEMORY;
  }
  ddp_status_t st = DDP_OK;
  if (z->opts.shard_buckets)
    st = shard_buckets(z, msg, cap);
  else /* _get_assigned_rank: bucket_index % world_size */
    for (size_t b = 0; st == DDP_OK && b < z->nb; b++)
      st = add_assignment(z, b, 0, z->bk[b].n, (int)(b % (size_t)z->world));
  if (st != DDP_OK) {
    if (!msg[0])
      snprintf(msg, cap, "zero overlap: the DDP buckets do not partition the parameters (%s)",
               ddp_status_str(st));
    return st;
  }
  for (size_t i = 0; i < z->n; i++)
    if (z->owner[i] < 0) {
      snprintf(msg, cap,
               "zero overlap: optimizer parameter %zu is in no DDP bucket (frozen parameters "
               "belong in no optimizer group)",
               i);
      return DDP_ERR_INVALID_ARGUMENT;
    }
  unsigned char *at = z->store;
  for (size_t a = 0; a < z->nasg; a++) { /* _build_ddp_param_buckets */
    assignment_t *x = &z->asg[a];
    x->tensor = at;
    for (size_t k = x->first; k < x->first + x->count; k++) {
      size_t i = z->bk[x->bucket].idx[k];
      ddp_tensor_t *p = z->params[i].param;
      memcpy(at, p->data, (size_t)p->numel * z->esz);
      z->home[i] = p->data;
      p->data = at;
      at += (size_t)p->numel * z->esz;
    }
  }
  for (size_t i = 0; i < z->n; i++) {
    const ddp_tensor_t *p = z->params[i].param;
    z->g[i] = *p;
    z->g[i].data = NULL;
    z->g[i].owns = false;
  }
  ddp_error_t e = {0};
  st = make_optimizers(z, &e);
  if (st != DDP_OK) {
    snprintf(msg, cap, "%.900s", e.msg);
    return st;
  }
  z->status = INITIALIZED;
  if (z->rank == 0)
    ddp__log(z->rank, DDP_LOG_INFO, "zero overlap: %zu DDP buckets and %zu bucket assignments",
             z->nb, z->nasg);
  return DDP_OK;
}

/* _hook_with_zero_step_setup. */
static ddp_status_t setup(ddp_zero_overlap_t *z, const ddp_grad_bucket_t *b, char *msg,
                          size_t cap) {
  if (!z->opts.has_rebuilt_buckets(z->opts.user)) return DDP_OK;
  if (z->status == UNINITIALIZED) z->status = DDP_HAS_REBUILT_BUCKETS;
  if (z->status != DDP_HAS_REBUILT_BUCKETS) return DDP_OK;
  if (b->index == 0 && z->nb > 0) return init_overlap(z, msg, cap);
  return save_bucket(z, b, msg, cap);
}

/* ---------------------------------------------------------------- the step -------- */

/* _perform_local_step over bucket b's assignment to this rank, with the reduced gradients
 * at data (n elements of dt; converted when the result is not the parameters' dtype). */
static ddp_status_t local_step(ddp_zero_overlap_t *z, size_t b, const void *data, size_t n,
                               ddp_dtype_t dt, char *msg, size_t cap) {
  void *conv = NULL;
  if (dt != z->dt) {
    conv = ddp__malloc((n ? n : 1) * z->esz);
    if (!conv) {
      snprintf(msg, cap, "zero overlap: out of memory");
      return DDP_ERR_NO_MEMORY;
    }
    for (size_t k = 0; k < n; k++) {
      double v = ddp_dtype_load(data, dt, k);
      if (z->dt == DDP_F64)
        ((double *)conv)[k] = v;
      else
        ((float *)conv)[k] = (float)v;
    }
    data = conv;
  }
  const bucket_info_t *bi = &z->bk[b];
  for (size_t a = 0; a < z->nasg; a++) {
    const assignment_t *x = &z->asg[a];
    if (x->bucket != b || x->rank != z->rank) continue;
    for (size_t k = x->first; k < x->first + x->count; k++)
      z->g[bi->idx[k]].data = (char *)data + bi->idx[bi->n + k] * z->esz;
  }
  ddp_status_t st = DDP_OK;
  for (size_t g = 0; g < z->ngroups && st == DDP_OK; g++) {
    ddp_error_t e = {0};
    st = ddp_optim_step(z->opt[g], &e);
    if (st != DDP_OK) snprintf(msg, cap, "zero overlap: step of bucket %zu: %.900s", b, e.msg);
  }
  for (size_t i = 0; i < z->n; i++) z->g[i].data = NULL;
  ddp__free(conv);
  return st;
}

/* _broadcast_bucket: each assignment of bucket b from its rank, ranks in increasing order. */
static ddp_status_t broadcast_bucket(ddp_zero_overlap_t *z, size_t b, char *msg, size_t cap) {
  for (int r = 0; r < z->world; r++)
    for (size_t a = 0; a < z->nasg; a++) {
      const assignment_t *x = &z->asg[a];
      if (x->bucket != b || x->rank != r) continue;
      ddp_status_t st = ddp_broadcast(z->pg, x->tensor, x->numel, z->dt, r, &z->bcast[z->nbcast]);
      if (st != DDP_OK) {
        ddp_error_t pe;
        ddp_pg_last_error_copy(z->pg, &pe);
        snprintf(msg, cap, "zero overlap: broadcast of bucket %zu from rank %d: %.900s", b, r,
                 pe.msg);
        return st;
      }
      z->nbcast++;
    }
  return DDP_OK;
}

/* wait_for_broadcasts and clear_per_iter_info. */
static ddp_status_t end_iteration(ddp_zero_overlap_t *z, char *msg, size_t cap) {
  ddp_status_t st = DDP_OK;
  for (size_t k = 0; k < z->nbcast; k++) {
    ddp_status_t s = ddp_work_wait_free(z->bcast[k]);
    if (s != DDP_OK && st == DDP_OK) {
      ddp_error_t pe;
      ddp_pg_last_error_copy(z->pg, &pe);
      snprintf(msg, cap, "zero overlap: parameter broadcast: %.900s", pe.msg);
      st = s;
    }
  }
  z->nbcast = 0;
  z->seen = 0;
  memset(z->fut, 0, z->nb * sizeof *z->fut);
  if (st == DDP_OK) z->updates++;
  return st;
}

static bool owns(const ddp_zero_overlap_t *z, size_t b) {
  for (size_t a = 0; a < z->nasg; a++)
    if (z->asg[a].bucket == b && z->asg[a].rank == z->rank) return true;
  return false;
}

/* Waits for bucket b's reduction w and steps this rank's part of it. */
static ddp_status_t wait_and_step(ddp_zero_overlap_t *z, size_t b, ddp_comm_work_t *w, char *msg,
                                  size_t cap) {
  const void *data = NULL;
  size_t cnt = 0;
  ddp_dtype_t dt = z->dt;
  ddp_status_t st = ddp_comm_work_wait(w, &data, &cnt, &dt);
  if (st != DDP_OK) {
    snprintf(msg, cap, "zero overlap: reduction of bucket %zu: %s", b, ddp_comm_work_error(w));
    return st;
  }
  if (cnt != z->bk[b].numel) {
    snprintf(msg, cap,
             "zero overlap: the comm hook resolved bucket %zu to %zu elements, expected %zu", b,
             cnt, z->bk[b].numel);
    return DDP_ERR_INVALID_USAGE;
  }
  return local_step(z, b, data, cnt, dt, msg, cap);
}

/* hook_with_zero_step at the last bucket: every bucket in order, its owners waiting for its
 * reduction and stepping, then every rank broadcasting it; then all broadcasts waited for. */
static ddp_status_t step_all(ddp_zero_overlap_t *z, char *msg, size_t cap) {
  for (size_t b = 0; b < z->nb; b++) {
    if (owns(z, b)) {
      if (!z->fut[b]) {
        snprintf(msg, cap, "zero overlap: the reduction of bucket %zu was not saved on rank %d", b,
                 z->rank);
        return DDP_ERR_INTERNAL;
      }
      DDP_CHECK(wait_and_step(z, b, z->fut[b], msg, cap));
    }
    DDP_CHECK(broadcast_bucket(z, b, msg, cap));
  }
  return end_iteration(z, msg, cap);
}

/* hook_with_zero_step_interleaved's continuation of one bucket's work. */
struct call {
  ddp_zero_overlap_t *z;
  size_t b;
  ddp_comm_work_t *inner;
};

static void call_free(void *user) {
  call_t *c = user;
  ddp_comm_work_free(c->inner);
  ddp__free(c);
}

static ddp_status_t zero_step(void *user, ddp_comm_work_t *w) {
  call_t *c = user;
  ddp_zero_overlap_t *z = c->z;
  char msg[1024] = "";
  const void *data = NULL;
  size_t cnt = 0;
  ddp_dtype_t dt = z->dt;
  ddp_status_t st = ddp_comm_work_wait(c->inner, &data, &cnt, &dt);
  if (st != DDP_OK) {
    ddp_comm_work_set_error(w, ddp_comm_work_error(c->inner));
    return st;
  }
  ddp_comm_work_set_result(w, (void *)data, cnt, dt);
  z->seen++;
  if (owns(z, c->b)) st = wait_and_step(z, c->b, c->inner, msg, sizeof msg);
  if (st == DDP_OK) st = broadcast_bucket(z, c->b, msg, sizeof msg);
  if (st == DDP_OK && z->seen == z->nb) st = end_iteration(z, msg, sizeof msg);
  if (st != DDP_OK) ddp_comm_work_set_error(w, msg);
  return st;
}

/* hook_with_zero_fn / hook_with_zero_interleaved_fn. */
static ddp_status_t overlap_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                 ddp_comm_work_t **out) {
  ddp_zero_overlap_t *z = state;
  DDP_REQUIRE(z && z->magic == OVL_MAGIC && b && out);
  *out = NULL;
  ddp_comm_work_t *fut = NULL;
  ddp_status_t ist = z->inner.fn(z->inner.state, pg, b, &fut);
  *out = fut;
  if (ist != DDP_OK) return ist;
  char msg[1024] = "";
  ddp_status_t st = setup(z, b, msg, sizeof msg);
  if (st == DDP_OK && z->status == INITIALIZED && b->index >= z->nb) {
    snprintf(msg, sizeof msg,
             "zero overlap: bucket %zu, but DDP had %zu buckets when they were recorded (the "
             "layout must not change after the rebuild)",
             b->index, z->nb);
    st = DDP_ERR_INVALID_USAGE;
  }
  if (st != DDP_OK || z->status != INITIALIZED) goto out;
  if (z->opts.kind == DDP_ZERO_HOOK_STEP) {
    if (b->index != z->seen) {
      snprintf(msg, sizeof msg,
               "zero overlap: bucket %zu after %zu buckets (bucket indices are "
               "not in incremental order)",
               b->index, z->seen);
      st = DDP_ERR_INTERNAL;
      goto out;
    }
    z->seen++;
    if (owns(z, b->index)) z->fut[b->index] = fut;
    if (b->index + 1 == z->nb) st = step_all(z, msg, sizeof msg);
    goto out;
  }
  call_t *c = ddp__calloc(1, sizeof *c);
  ddp_comm_work_t *w = NULL;
  st = c ? ddp_comm_work_create(&w) : DDP_ERR_NO_MEMORY;
  if (st != DDP_OK) {
    ddp__free(c);
    snprintf(msg, sizeof msg, "zero overlap: out of memory");
    goto out;
  }
  *c = (call_t){z, b->index, fut};
  ddp_comm_work_on_free(w, call_free, c);
  ddp_comm_work_then(w, zero_step, c);
  *out = w;
out:
  if (st != DDP_OK && *out) ddp_comm_work_set_error(*out, msg);
  return st;
}

/* ---------------------------------------------------------------- accessors ------- */

static void inner_stats(void *state, ddp_comm_hook_stats_t *out) {
  ddp_zero_overlap_t *z = state;
  z->inner.stats(z->inner.state, out);
}

static ddp_status_t inner_save(void *state, const char *path, ddp_error_t *err) {
  ddp_zero_overlap_t *z = state;
  return z->inner.save_state(z->inner.state, path, err);
}

static ddp_status_t inner_load(void *state, const char *path, ddp_error_t *err) {
  ddp_zero_overlap_t *z = state;
  return z->inner.load_state(z->inner.state, path, err);
}

void ddp_zero_overlap_hook(ddp_zero_overlap_t *z, ddp_comm_hook_t *out) {
  DDP_REQUIRE(z && z->magic == OVL_MAGIC && out);
  *out = (ddp_comm_hook_t){.fn = overlap_hook,
                           .state = z,
                           .name = z->name,
                           .stats = z->inner.stats ? inner_stats : NULL,
                           .save_state = z->inner.save_state ? inner_save : NULL,
                           .load_state = z->inner.load_state ? inner_load : NULL};
}

void ddp_zero_overlap_set_lr(ddp_zero_overlap_t *z, double lr) {
  DDP_REQUIRE(z && z->magic == OVL_MAGIC);
  z->lr = lr;
  for (size_t g = 0; g < z->ngroups; g++)
    if (z->opt[g]) ddp_optim_set_lr(z->opt[g], lr);
}

int64_t ddp_zero_overlap_updates(const ddp_zero_overlap_t *z) {
  DDP_REQUIRE(z && z->magic == OVL_MAGIC);
  return z->updates;
}

int ddp_zero_overlap_owner(const ddp_zero_overlap_t *z, size_t i) {
  DDP_REQUIRE(z && z->magic == OVL_MAGIC && i < z->n);
  return z->owner[i];
}

size_t ddp_zero_overlap_optim_bytes(const ddp_zero_overlap_t *z) {
  DDP_REQUIRE(z && z->magic == OVL_MAGIC);
  size_t b = 0;
  for (size_t g = 0; g < z->ngroups; g++)
    if (z->opt[g]) b += ddp_optim_state_bytes(z->opt[g]);
  return b;
}
