/* ZeRO stages 1 and 2 (include/ddp/shard.h): ZeroRedundancyOptimizer's partition, the
 * owners' optimizers, clipping by the global norm in parameter order, and the parameters'
 * return to every rank (a broadcast per parameter from its owner). Stage 2's reduction of
 * the gradients to their owners, bucket by bucket during backward, is zero2.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/io.h"
#include "ddp/shard.h"
#include "shard/zero2.h"
#include "shard/zero_view.h"

#define ZERO_MAGIC 0x5a45524fu /* "ZERO" */

struct ddp_zero {
  uint32_t magic;
  ddp_pg_t *pg;
  int rank, world;
  ddp_zero_options_t opts;
  size_t n;                  /* parameters, all groups */
  ddp_optim_param_t *params; /* [n] the caller's pairs, global order */
  int *owner;                /* [n] */
  size_t ngroups;
  size_t gn[DDP_ZERO_MAX_GROUPS];        /* parameters per group */
  ddp_optim_t *opt[DDP_ZERO_MAX_GROUPS]; /* this rank's owned parameters of each group */
  ddp_dtype_t dt;
  size_t esz;
  ddp__zero2_t *z2;    /* stage 2: the gradient reduction (zero2.c) */
  double *norms;       /* [n] */
  ddp_tensor_t **clip; /* [n] owned grads; the others point at `none` */
  ddp_tensor_t none;   /* a None gradient */
  ddp_work_t **works;  /* [max(n, W)] */

  ddp__zero_view_t view; /* stage 1 with parameters_as_bucket_view */
};

void ddp_zero_partition(const int64_t *numel, const size_t *group_n, size_t ngroups, int world,
                        int *owner) {
  DDP_REQUIRE(world >= 1 && (numel || ngroups == 0));
  int64_t *sizes = ddp__calloc((size_t)world, sizeof *sizes);
  DDP_REQUIRE(sizes);
  for (size_t g = 0, base = 0; g < ngroups; base += group_n[g], g++) {
    size_t m = group_n[g];
    /* sorted(key=numel, reverse=True) is stable: equal sizes keep their order. Insertion
     * sort by index (groups are small); ties keep the lower index first. */
    size_t *ord = ddp__calloc(m ? m : 1, sizeof *ord);
    DDP_REQUIRE(ord);
    for (size_t i = 0; i < m; i++) {
      size_t j = i;
      while (j > 0 && numel[base + ord[j - 1]] < numel[base + i]) {
        ord[j] = ord[j - 1];
        j--;
      }
      ord[j] = i;
    }
    for (size_t k = 0; k < m; k++) {
      int r = 0; /* _get_min_index: the first rank with the smallest total */
      for (int q = 1; q < world; q++)
        if (sizes[q] < sizes[r]) r = q;
      owner[base + ord[k]] = r;
      sizes[r] += numel[base + ord[k]];
    }
    ddp__free(ord);
  }
  ddp__free(sizes);
}

static ddp_status_t check_params(const ddp_zero_group_t *groups, size_t ngroups, ddp_dtype_t *dt,
                                 ddp_error_t *err) {
  bool have = false;
  for (size_t g = 0, i = 0; g < ngroups; g++) {
    for (size_t k = 0; k < groups[g].n; k++, i++) {
      const ddp_tensor_t *p = groups[g].params[k].param;
      DDP_REQUIRE(p && groups[g].params[k].grad);
      if (p->dtype != DDP_F32 && p->dtype != DDP_F64)
        return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                          "zero: parameter %zu is %s; ZeRO takes f32 or f64 parameters", i,
                          ddp_dtype_name(p->dtype));
      if (have && p->dtype != *dt)
        return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                          "zero: parameter %zu is %s but earlier parameters are %s", i,
                          ddp_dtype_name(p->dtype), ddp_dtype_name(*dt));
      *dt = p->dtype;
      have = true;
    }
  }
  return DDP_OK;
}

/* The partition and this rank's optimizers. */
static ddp_status_t build(ddp_zero_t *z, const ddp_zero_group_t *groups, ddp_error_t *err) {
  int64_t *numel = ddp__calloc(z->n ? z->n : 1, sizeof *numel);
  size_t gn[DDP_ZERO_MAX_GROUPS];
  ddp_optim_param_t *mine = ddp__calloc(z->n ? z->n : 1, sizeof *mine);
  ddp_status_t st = DDP_OK;
  if (!numel || !mine) {
    st = ddp__error(err, z->rank, DDP_ERR_NO_MEMORY, "zero: out of memory (%zu parameters)", z->n);
    goto out;
  }
  for (size_t i = 0; i < z->n; i++) numel[i] = z->params[i].param->numel;
  for (size_t g = 0; g < z->ngroups; g++) gn[g] = groups[g].n;
  ddp_zero_partition(numel, gn, z->ngroups, z->world, z->owner);
  for (size_t g = 0, base = 0; g < z->ngroups && st == DDP_OK; base += groups[g].n, g++) {
    size_t m = 0;
    for (size_t k = 0; k < groups[g].n; k++)
      if (z->owner[base + k] == z->rank) mine[m++] = groups[g].params[k];
    st = ddp_optim_create(&groups[g].opts, mine, m, &z->opt[g], err);
  }
out:
  ddp__free(numel);
  ddp__free(mine);
  return st;
}

ddp_status_t ddp_zero_create(ddp_pg_t *pg, const ddp_zero_options_t *opts,
                             const ddp_zero_group_t *groups, size_t ngroups, ddp_zero_t **out,
                             ddp_error_t *err) {
  DDP_REQUIRE(pg && opts && out && (groups || ngroups == 0));
  DDP_REQUIRE(opts->struct_size >= sizeof(ddp_zero_options_t));
  *out = NULL;
  int rank = ddp_pg_rank(pg);
  if (opts->stage != 1 && opts->stage != 2)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "zero: stage %d is not supported (1: optimizer state sharded, 2: "
                      "gradients too; stage 3 is ddp_fsdp_create)",
                      opts->stage);
  if (!strcmp(ddp_grad_arith_name(opts->arith), "?"))
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "zero: gradient arithmetic %d is not one of " DDP_GRAD_ARITH_CHOICES,
                      (int)opts->arith);
  if (opts->parameters_as_bucket_view && opts->stage != 1)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "zero: parameters_as_bucket_view is ZeroRedundancyOptimizer's (stage 1); "
                      "stage %d keeps its own flat buffer",
                      opts->stage);
  if (ngroups > DDP_ZERO_MAX_GROUPS)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "zero: %zu parameter groups; at most %d",
                      ngroups, DDP_ZERO_MAX_GROUPS);
  ddp_dtype_t dt = DDP_F32;
  DDP_CHECK(check_params(groups, ngroups, &dt, err));
  ddp_zero_t *z = ddp__calloc(1, sizeof *z);
  if (!z) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "zero: out of memory");
  *z = (ddp_zero_t){.magic = ZERO_MAGIC,
                    .pg = pg,
                    .rank = rank,
                    .world = ddp_pg_size(pg),
                    .opts = *opts,
                    .ngroups = ngroups,
                    .dt = dt,
                    .esz = ddp_dtype_size(dt)};
  z->none.dtype = dt;
  for (size_t g = 0; g < ngroups; g++) z->n += (z->gn[g] = groups[g].n);
  size_t n1 = z->n ? z->n : 1;
  z->params = ddp__calloc(n1, sizeof *z->params);
  z->owner = ddp__calloc(n1, sizeof *z->owner);
  z->norms = ddp__calloc(n1, sizeof *z->norms);
  z->clip = ddp__calloc(n1, sizeof *z->clip);
  z->works = ddp__calloc(n1 > (size_t)z->world ? n1 : (size_t)z->world, sizeof *z->works);
  ddp_status_t st = DDP_OK;
  if (!z->params || !z->owner || !z->norms || !z->clip || !z->works) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "zero: out of memory (%zu parameters)", z->n);
    goto fail;
  }
  for (size_t g = 0, i = 0; g < ngroups; g++)
    for (size_t k = 0; k < groups[g].n; k++) z->params[i++] = groups[g].params[k];
  DDP_CHECK_GOTO(build(z, groups, err), st, fail);
  for (size_t i = 0; i < z->n; i++) z->clip[i] = z->owner[i] == rank ? z->params[i].grad : &z->none;
  if (opts->parameters_as_bucket_view)
    DDP_CHECK_GOTO(ddp__zero_view_build(&z->view, z->params, z->n, z->owner, z->gn, ngroups,
                                        z->world, rank, err),
                   st, fail);
  if (opts->stage == 2) {
    ddp__zero2_cfg_t c = {.pg = pg,
                          .rank = rank,
                          .world = z->world,
                          .n = z->n,
                          .params = z->params,
                          .owner = z->owner,
                          .dt = z->dt,
                          .arith = opts->arith,
                          .divide_in_place = opts->divide_in_place};
    DDP_CHECK_GOTO(ddp__zero2_create(&c, DDP_ZERO_BUCKET_BYTES, DDP_ZERO_FIRST_BUCKET_BYTES, &z->z2,
                                     err),
                   st, fail);
  }
  *out = z;
  return DDP_OK;
fail:
  ddp_zero_destroy(z);
  return st;
}

void ddp_zero_destroy(ddp_zero_t *z) {
  if (!z) return;
  DDP_REQUIRE(z->magic == ZERO_MAGIC);
  for (size_t g = 0; g < z->ngroups; g++) ddp_optim_destroy(z->opt[g]);
  ddp__zero_view_free(&z->view);
  ddp__free(z->params);
  ddp__free(z->owner);
  ddp__free(z->norms);
  ddp__free(z->clip);
  ddp__free(z->works);
  ddp__zero2_destroy(z->z2);
  z->magic = 0;
  ddp__free(z);
}

int ddp_zero_stage(const ddp_zero_t *z) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  return z->opts.stage;
}

size_t ddp_zero_num_params(const ddp_zero_t *z) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  return z->n;
}

int ddp_zero_owner(const ddp_zero_t *z, size_t i) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC && i < z->n);
  return z->owner[i];
}

/* Waits for works[0..m) in order; the first failure, with the group's message, is returned
 * (the later works end by their deadlines and are freed). */
static ddp_status_t wait_all(ddp_zero_t *z, size_t m, const char *what, ddp_error_t *err) {
  ddp_status_t st = DDP_OK;
  for (size_t k = 0; k < m; k++) {
    ddp_status_t s = ddp_work_wait_free(z->works[k]);
    z->works[k] = NULL;
    if (s != DDP_OK && st == DDP_OK) st = s;
  }
  if (st == DDP_OK) return DDP_OK;
  ddp_error_t pe;
  ddp_pg_last_error_copy(z->pg, &pe);
  return ddp__error_quiet(err, st, "zero: %s: %s", what, pe.msg);
}

static ddp_status_t coll(ddp_zero_t *z, ddp_status_t st, const char *what, ddp_error_t *err) {
  if (st != DDP_OK) {
    ddp_error_t pe;
    ddp_pg_last_error_copy(z->pg, &pe);
    return ddp__error_quiet(err, st, "zero: %s: %s", what, pe.msg);
  }
  return wait_all(z, 1, what, err);
}

ddp_status_t ddp_zero_attach_model(ddp_zero_t *z, ddp_model_t *model, double bucket_cap_mb,
                                   ddp_error_t *err) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC && model);
  if (z->opts.stage != 2)
    return ddp__error(err, z->rank, DDP_ERR_INVALID_USAGE,
                      "zero: ddp_zero_attach_model is for stage 2 (this handle is stage %d)",
                      z->opts.stage);
  size_t cap = DDP_ZERO_BUCKET_BYTES, first = DDP_ZERO_FIRST_BUCKET_BYTES;
  if (bucket_cap_mb > 0) cap = first = (size_t)(bucket_cap_mb * 1024 * 1024);
  return ddp__zero2_attach(z->z2, model, cap, first, err);
}

void ddp_zero_set_sync(ddp_zero_t *z, bool sync) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  if (z->z2) ddp__zero2_set_sync(z->z2, sync);
}

ddp_status_t ddp_zero_reduce_grads(ddp_zero_t *z, ddp_error_t *err) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  if (z->opts.stage < 2) return DDP_OK;
  return ddp__zero2_reduce(z->z2, err);
}

/* --sharding_arithmetic deepspeed or deepspeed_allreduce: DeepSpeed ZeRO-1/2's clipping
 * (arith.c); stage 2's gradients are held by their owners. */
static ddp_status_t clip_deepspeed(ddp_zero_t *z, double max_norm, double *total_norm,
                                   ddp_error_t *err) {
  ddp_tensor_t **g = ddp__calloc(z->n ? z->n : 1, sizeof *g);
  if (!g) return ddp__error(err, z->rank, DDP_ERR_NO_MEMORY, "zero: out of memory");
  for (size_t i = 0; i < z->n; i++) g[i] = z->params[i].grad;
  ddp_status_t st = ddp_grad_arith_clip_deepspeed(z->pg, g, z->opts.stage == 2 ? z->owner : NULL,
                                                  z->gn, z->ngroups, z->clip, z->dt, max_norm,
                                                  total_norm, err);
  ddp__free(g);
  return st;
}

ddp_status_t ddp_zero_clip_grad_norm(ddp_zero_t *z, double max_norm, double *total_norm,
                                     ddp_error_t *err) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  if (z->opts.arith == DDP_GRAD_ARITH_DEEPSPEED ||
      z->opts.arith == DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE)
    return clip_deepspeed(z, max_norm, total_norm, err);
  ddp_grad_norms(z->clip, z->n, z->norms); /* 0 for the slots of other owners */
  if (z->n)
    DDP_CHECK(
        coll(z, ddp_allreduce(z->pg, z->norms, z->norms, z->n, DDP_F64, DDP_OP_SUM, &z->works[0]),
             "gradient norm allreduce", err));
  ddp_clip_grad_norm_from_norms(z->clip, z->n, z->norms, z->dt, max_norm, total_norm);
  return DDP_OK;
}

/* _sync_params: each rank's parameters from it, rank by rank (both stages). */
static ddp_status_t sync_params(ddp_zero_t *z, ddp_error_t *err) {
  size_t m = 0;
  ddp_status_t st = DDP_OK;
  if (z->opts.parameters_as_bucket_view) { /* stage 1: one broadcast per rank's bucket */
    st = ddp__zero_view_sync(&z->view, z->pg, z->dt, z->works, &m);
    ddp_status_t ws = wait_all(z, m, "parameter bucket broadcast", err);
    return st != DDP_OK ? coll(z, st, "parameter bucket broadcast", err) : ws;
  }
  for (int r = 0; r < z->world && st == DDP_OK; r++)
    for (size_t i = 0; i < z->n && st == DDP_OK; i++) {
      if (z->owner[i] != r) continue;
      ddp_tensor_t *p = z->params[i].param;
      st = ddp_broadcast(z->pg, p->data, (size_t)p->numel, z->dt, r, &z->works[m]);
      if (st == DDP_OK) m++;
    }
  ddp_status_t ws = wait_all(z, m, "parameter broadcast", err);
  return st != DDP_OK ? coll(z, st, "parameter broadcast", err) : ws;
}

ddp_status_t ddp_zero_step(ddp_zero_t *z, double lr, ddp_error_t *err) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  for (size_t g = 0; g < z->ngroups; g++) {
    ddp_optim_set_lr(z->opt[g], lr);
    DDP_CHECK(ddp_optim_step(z->opt[g], err));
  }
  return sync_params(z, err);
}

void ddp_zero_zero_grad(ddp_zero_t *z, bool set_to_none) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  for (size_t i = 0; i < z->n; i++) {
    ddp_tensor_t *g = z->params[i].grad;
    if (!g->data) continue;
    if (set_to_none) {
      ddp_tensor_t hdr = *g;
      ddp_tensor_free(g);
      *g = hdr;
      g->data = NULL;
      g->owns = false;
    } else {
      memset(g->data, 0, (size_t)g->numel * z->esz);
    }
  }
}

void ddp_zero_state_bytes(const ddp_zero_t *z, size_t *param_bytes, size_t *grad_bytes,
                          size_t *optim_bytes) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC);
  size_t pb = 0, gb = 0, ob = 0;
  for (size_t i = 0; i < z->n; i++) {
    pb += (size_t)z->params[i].param->numel * z->esz;
    const ddp_tensor_t *g = z->params[i].grad;
    if (g->data) gb += (size_t)g->numel * z->esz;
  }
  for (size_t g = 0; g < z->ngroups; g++) ob += ddp_optim_state_bytes(z->opt[g]);
  if (param_bytes) *param_bytes = pb;
  if (grad_bytes) *grad_bytes = gb;
  if (optim_bytes) *optim_bytes = ob;
}

/* ---------------------------------------------------------------- checkpoints ----- */

/* The group-local indices of the parameters of group g this rank owns, in order (the
 * order of its optimizer's parameters): *out malloc'd, *m of them. */
static ddp_status_t owned_indices(const ddp_zero_t *z, size_t g, size_t **out, size_t *m,
                                  ddp_error_t *err) {
  size_t base = 0;
  for (size_t h = 0; h < g; h++) base += z->gn[h];
  *out = ddp__calloc(z->gn[g] ? z->gn[g] : 1, sizeof **out);
  if (!*out) return ddp__error(err, z->rank, DDP_ERR_NO_MEMORY, "zero: out of memory");
  *m = 0;
  for (size_t k = 0; k < z->gn[g]; k++)
    if (z->owner[base + k] == z->rank) (*out)[(*m)++] = k;
  return DDP_OK;
}

ddp_status_t ddp_zero_optim_save(const ddp_zero_t *z, size_t group, const char *path,
                                 ddp_error_t *err) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC && group < z->ngroups && path);
  size_t *idx, m;
  DDP_CHECK(owned_indices(z, group, &idx, &m, err));
  ddp_status_t st = ddp_optim_save_indexed(z->opt[group], path, idx, err);
  ddp__free(idx);
  return st;
}

ddp_status_t ddp_zero_optim_load(ddp_zero_t *z, size_t group, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(z && z->magic == ZERO_MAGIC && group < z->ngroups && path);
  size_t *idx, m;
  DDP_CHECK(owned_indices(z, group, &idx, &m, err));
  ddp_status_t st = ddp_optim_load_indexed(z->opt[group], path, idx, err);
  ddp__free(idx);
  return st;
}

/* One tensor of the consolidated file: its parameter index, the rank of its key in
 * ddp_optim_save's order, and where it comes from. */
typedef struct merged {
  size_t index;
  int key;
  size_t file, entry;
} merged_t;

static int key_rank(const char *key) {
  static const char *const order[] = {"momentum_buffer", "step", "exp_avg", "exp_avg_sq",
                                      "max_exp_avg_sq"};
  for (int k = 0; k < 5; k++)
    if (!strcmp(key, order[k])) return k;
  return -1;
}

static int cmp_merged(const void *a, const void *b) {
  const merged_t *x = a, *y = b;
  if (x->index != y->index) return x->index < y->index ? -1 : 1;
  return (x->key > y->key) - (x->key < y->key);
}

/* Every tensor name of shard f is "state.<i>.<key>" with a known key. */
static ddp_status_t collect(ddp_st_file_t *f, const char *path, size_t fi, merged_t *out, size_t *n,
                            ddp_error_t *err) {
  for (size_t e = 0; e < ddp_st_count(f); e++) {
    const char *nm = ddp_st_name(f, e), *dot = NULL;
    char *end = NULL;
    unsigned long long i = 0;
    if (!strncmp(nm, "state.", 6) && nm[6] >= '0' && nm[6] <= '9') {
      i = strtoull(nm + 6, &end, 10);
      dot = *end == '.' ? end + 1 : NULL;
    }
    int k = dot ? key_rank(dot) : -1;
    if (k < 0)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "zero consolidate: %s: tensor '%s' is not optimizer state "
                        "(state.<index>.<key>)",
                        path, nm);
    out[(*n)++] = (merged_t){(size_t)i, k, fi, e};
  }
  return DDP_OK;
}

ddp_status_t ddp_zero_consolidate(const char *const *shards, size_t nshards, const char *out,
                                  ddp_error_t *err) {
  DDP_REQUIRE(shards && nshards > 0 && out);
  ddp_st_file_t **f = ddp__calloc(nshards, sizeof *f);
  merged_t *m = NULL;
  ddp_st_entry_t *ent = NULL;
  ddp_tensor_t *views = NULL;
  size_t total = 0, n = 0;
  ddp_status_t st = f ? DDP_OK
                      : ddp__error(err, -1, DDP_ERR_NO_MEMORY, "zero consolidate: out of memory");
  for (size_t s = 0; st == DDP_OK && s < nshards; s++) {
    st = ddp_st_open(shards[s], DDP_ST_READ, &f[s], err);
    if (st == DDP_OK) total += ddp_st_count(f[s]);
  }
  /* The same optimizer and hyper-parameters in every shard (they are one optimizer's). */
  for (size_t s = 1; st == DDP_OK && s < nshards; s++) {
    size_t nm = ddp_st_meta_count(f[0]);
    bool same = nm == ddp_st_meta_count(f[s]);
    for (size_t k = 0; same && k < nm; k++) {
      const char *v = ddp_st_meta_get(f[s], ddp_st_meta_key(f[0], k));
      same = v && !strcmp(v, ddp_st_meta_value(f[0], k));
    }
    if (!same)
      st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "zero consolidate: %s and %s hold different optimizers (their metadata "
                      "differ)",
                      shards[0], shards[s]);
  }
  if (st == DDP_OK) {
    m = ddp__calloc(total ? total : 1, sizeof *m);
    ent = ddp__calloc(total ? total : 1, sizeof *ent);
    views = ddp__calloc(total ? total : 1, sizeof *views);
    if (!m || !ent || !views)
      st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "zero consolidate: out of memory (%zu tensors)",
                      total);
  }
  for (size_t s = 0; st == DDP_OK && s < nshards; s++) st = collect(f[s], shards[s], s, m, &n, err);
  if (st == DDP_OK) qsort(m, n, sizeof *m, cmp_merged);
  for (size_t k = 0; st == DDP_OK && k < n; k++) {
    if (k > 0 && m[k].index == m[k - 1].index && m[k].key == m[k - 1].key) {
      st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "zero consolidate: '%s' is in both %s and %s (shards of one partition are "
                      "disjoint)",
                      ddp_st_name(f[m[k].file], m[k].entry), shards[m[k - 1].file],
                      shards[m[k].file]);
      break;
    }
    st = ddp_st_tensor(f[m[k].file], m[k].entry, &views[k]);
    ent[k] = (ddp_st_entry_t){ddp_st_name(f[m[k].file], m[k].entry), &views[k]};
  }
  if (st == DDP_OK) {
    size_t nm = ddp_st_meta_count(f[0]);
    const char *keys[32], *vals[32];
    for (size_t k = 0; k < nm && k < 32; k++) {
      keys[k] = ddp_st_meta_key(f[0], k);
      vals[k] = ddp_st_meta_value(f[0], k);
    }
    st = ddp_st_write(out, ent, n, keys, vals, nm < 32 ? nm : 32, err);
  }
  for (size_t s = 0; f && s < nshards; s++) ddp_st_close(f[s]);
  ddp__free(f);
  ddp__free(m);
  ddp__free(ent);
  ddp__free(views);
  return st;
}
