/* ZeRO-3 checkpoints (include/ddp/shard.h, docs/sharding.md): the optimizer state gathered
 * from the shards into full optimizers (FULL_STATE_DICT) and scattered back, and each
 * rank's flat shards written and read at any world size (SHARDED_STATE_DICT).
 *
 * Every position below is a flat element position in a unit's buffer (the parameters in
 * registration order): it does not depend on W, only the padding and the cut into shards
 * do. So a shard written at W is read at W' by copying, for each element range of the new
 * shard, the pieces of the old shards that cover it. The optimizers are elementwise, so a
 * piece's state is the slice of its parameter's state, whatever the cut. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/io.h"
#include "ddp/shard.h"
#include "shard/fsdp_internal.h"

#define FORMAT "libddp-fsdp-1"

typedef struct ctx {
  ddp_fsdp_t *f;
  ddp__fsdp_view_t v;
  size_t *unit;  /* [nparams] unit of parameter i */
  size_t *poff;  /* [nparams] its offset in the unit's flat buffer */
  size_t *local; /* [nparams] its position in its group's piece optimizer, SIZE_MAX none */
  ddp_error_t *err;
} ctx_t;

static void ctx_free(ctx_t *c) {
  ddp__free(c->unit);
  ddp__free(c->poff);
  ddp__free(c->local);
}

static ddp_status_t ctx_init(ctx_t *c, ddp_fsdp_t *f, ddp_error_t *err) {
  *c = (ctx_t){.f = f, .err = err};
  ddp__fsdp_view(f, &c->v);
  size_t n = c->v.nparams ? c->v.nparams : 1;
  c->unit = ddp__calloc(n, sizeof *c->unit);
  c->poff = ddp__calloc(n, sizeof *c->poff);
  c->local = ddp__calloc(n, sizeof *c->local);
  if (!c->unit || !c->poff || !c->local) {
    ctx_free(c);
    return ddp__error(err, c->v.rank, DDP_ERR_NO_MEMORY, "fsdp checkpoint: out of memory");
  }
  for (size_t ui = 0; ui < c->v.nunits; ui++) {
    ddp__fsdp_unit_view_t u;
    ddp__fsdp_unit(f, ui, &u);
    for (size_t k = 0; k < u.np; k++) c->unit[u.idx[k]] = ui, c->poff[u.idx[k]] = u.off[k];
  }
  size_t cnt[DDP_ZERO_MAX_GROUPS] = {0};
  for (size_t i = 0; i < c->v.nparams; i++) {
    int g = c->v.group[i];
    c->local[i] = g >= 0 && c->v.piece_of[i] != SIZE_MAX ? cnt[g]++ : SIZE_MAX;
  }
  return DDP_OK;
}

/* The slots of state the optimizers keep (ddp_optim_param_state's t[]), and their names. */
static size_t slots(const ctx_t *c, const char *names[3]) {
  if (!c->v.ngroups) return 0;
  const ddp_optim_options_t *o = ddp_optim_options(c->v.opt[0]);
  names[0] = o->kind == DDP_OPTIM_SGD ? "momentum_buffer" : "exp_avg";
  names[1] = "exp_avg_sq";
  names[2] = "max_exp_avg_sq";
  return o->kind == DDP_OPTIM_SGD ? 1 : o->amsgrad ? 3 : 2;
}

/* This rank's piece of parameter i: its state (false: none) and its flat start. */
static bool piece_state(const ctx_t *c, size_t i, double *step, ddp_tensor_t *t[3], size_t *at) {
  ddp__fsdp_unit_view_t u;
  ddp__fsdp_unit(c->f, c->unit[i], &u);
  *at = (size_t)c->v.rank * u.S + c->v.piece_at[c->v.piece_of[i]];
  return ddp_optim_param_state(c->v.opt[c->v.group[i]], c->local[i], step, t);
}

/* w: read after st, which sets it (the call is evaluated first) */
static ddp_status_t coll(const ctx_t *c, ddp_status_t st, ddp_work_t **w, const char *what) {
  if (st == DDP_OK) st = ddp_work_wait_free(*w);
  if (st == DDP_OK) return DDP_OK;
  ddp_error_t pe;
  ddp_pg_last_error_copy(c->v.pg, &pe);
  return ddp__error_quiet(c->err, st, "fsdp checkpoint: %s: %s", what, pe.msg);
}

/* The steps of every parameter's state (-1: none), all-gathered: any rank with a piece of
 * parameter i knows it (every piece of a parameter steps together). */
static ddp_status_t all_steps(const ctx_t *c, double *steps) {
  size_t n = c->v.nparams, W = (size_t)c->v.world;
  double *all = ddp__calloc(W * (n ? n : 1), sizeof *all);
  if (!all) return ddp__error(c->err, c->v.rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory");
  for (size_t i = 0; i < n; i++) {
    double s;
    ddp_tensor_t *t[3];
    size_t at;
    steps[i] = c->local[i] != SIZE_MAX && piece_state(c, i, &s, t, &at) ? s : -1;
  }
  ddp_work_t *w = NULL;
  ddp_status_t st = coll(c, ddp_allgather(c->v.pg, steps, all, n, DDP_F64, &w), &w,
                         "optimizer steps all_gather");
  for (size_t r = 0; st == DDP_OK && r < W; r++)
    for (size_t i = 0; i < n; i++)
      if (all[r * n + i] > steps[i]) steps[i] = all[r * n + i];
  ddp__free(all);
  return st;
}

ddp_status_t ddp_fsdp_optim_gather(ddp_fsdp_t *f, ddp_optim_t *const *full, const size_t *pos,
                                   ddp_error_t *err) {
  DDP_REQUIRE(f && (full || !pos) && pos);
  ctx_t c;
  DDP_CHECK(ctx_init(&c, f, err));
  const char *names[3];
  size_t ns = slots(&c, names), n = c.v.nparams;
  double *steps = ddp__calloc(n ? n : 1, sizeof *steps);
  ddp_status_t st = steps ? all_steps(&c, steps)
                          : ddp__error(err, c.v.rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory");
  for (size_t g = 0; g < c.v.ngroups; g++) /* the lr of the last step, as a state dict's */
    ddp_optim_set_lr(full[g], ddp_optim_get_lr(c.v.opt[g]));
  for (size_t i = 0; st == DDP_OK && i < n; i++) {
    ddp_tensor_t *t[3];
    if (c.v.group[i] >= 0)
      st = ddp_optim_param_state_set(full[c.v.group[i]], pos[i], steps[i] >= 0,
                                     steps[i] >= 0 ? steps[i] : 0, t, err);
  }
  for (size_t ui = 0; st == DDP_OK && ui < c.v.nunits; ui++) {
    ddp__fsdp_unit_view_t u;
    ddp__fsdp_unit(f, ui, &u);
    size_t padded = u.S * (size_t)c.v.world;
    unsigned char *mine = ddp__calloc(u.S, c.v.esz), *all = ddp__calloc(padded, c.v.esz);
    if (!mine || !all)
      st = ddp__error(err, c.v.rank, DDP_ERR_NO_MEMORY,
                      "fsdp: out of memory gathering unit %zu's optimizer state", ui);
    for (size_t s = 0; st == DDP_OK && s < ns; s++) {
      memset(mine, 0, u.S * c.v.esz);
      for (size_t k = 0; k < u.np; k++) {
        size_t i = u.idx[k], at;
        double step;
        ddp_tensor_t *t[3];
        if (c.local[i] == SIZE_MAX || !piece_state(&c, i, &step, t, &at) || !t[s]) continue;
        memcpy(mine + (at - (size_t)c.v.rank * u.S) * c.v.esz, t[s]->data, ddp_tensor_nbytes(t[s]));
      }
      ddp_work_t *w = NULL;
      st = coll(&c, ddp_allgather(c.v.pg, mine, all, u.S, c.v.dt, &w), &w,
                "optimizer state all_gather");
      for (size_t k = 0; st == DDP_OK && k < u.np; k++) {
        size_t i = u.idx[k];
        double step;
        ddp_tensor_t *t[3];
        if (c.v.group[i] < 0 || !ddp_optim_param_state(full[c.v.group[i]], pos[i], &step, t) ||
            !t[s])
          continue;
        memcpy(t[s]->data, all + u.off[k] * c.v.esz, ddp_tensor_nbytes(t[s]));
      }
    }
    ddp__free(mine);
    ddp__free(all);
  }
  ddp__free(steps);
  ctx_free(&c);
  return st;
}

ddp_status_t ddp_fsdp_optim_scatter(ddp_fsdp_t *f, ddp_optim_t *const *full, const size_t *pos,
                                    ddp_error_t *err) {
  DDP_REQUIRE(f && full && pos);
  ctx_t c;
  DDP_CHECK(ctx_init(&c, f, err));
  ddp_status_t st = DDP_OK;
  for (size_t g = 0; g < c.v.ngroups; g++) ddp_optim_set_lr(c.v.opt[g], ddp_optim_get_lr(full[g]));
  for (size_t i = 0; st == DDP_OK && i < c.v.nparams; i++) {
    if (c.local[i] == SIZE_MAX) continue;
    double step;
    ddp_tensor_t *src[3], *dst[3];
    bool has = ddp_optim_param_state(full[c.v.group[i]], pos[i], &step, src);
    st = ddp_optim_param_state_set(c.v.opt[c.v.group[i]], c.local[i], has, step, dst, err);
    size_t at;
    piece_state(&c, i, &step, dst, &at);
    for (size_t s = 0; st == DDP_OK && has && s < 3; s++)
      if (dst[s] && src[s])
        memcpy(dst[s]->data, (unsigned char *)src[s]->data + (at - c.poff[i]) * c.v.esz,
               ddp_tensor_nbytes(dst[s]));
  }
  ctx_free(&c);
  return st;
}

/* ---------------------------------------------------------------- SHARDED ---------- */

/* The metadata both files of a rank carry: what a reader checks before cutting. */
static void meta(const ctx_t *c, char *units, size_t cap, char world[16], char np[24]) {
  size_t len = 0;
  units[0] = 0;
  for (size_t ui = 0; ui < c->v.nunits && len + 24 < cap; ui++) {
    ddp__fsdp_unit_view_t u;
    ddp__fsdp_unit(c->f, ui, &u);
    len += (size_t)snprintf(units + len, cap - len, "%s%zu", ui ? "," : "", u.numel);
  }
  snprintf(world, 16, "%d", c->v.world);
  snprintf(np, 24, "%zu", c->v.nparams);
}

ddp_status_t ddp_fsdp_save_sharded(ddp_fsdp_t *f, const char *model_path, const char *optim_path,
                                   ddp_error_t *err) {
  DDP_REQUIRE(f && model_path && optim_path);
  ctx_t c;
  DDP_CHECK(ctx_init(&c, f, err));
  const char *names[3];
  size_t ns = slots(&c, names), nu = c.v.nunits, n = c.v.nparams;
  char units[8192], world[16], np[24], rank[16];
  meta(&c, units, sizeof units, world, np);
  snprintf(rank, sizeof rank, "%d", c.v.rank);
  const char *keys[5] = {"format", "world_size", "rank", "unit_numel", "num_params"};
  const char *vals[5] = {FORMAT, world, rank, units, np};
  ddp_st_entry_t *ent = ddp__calloc(nu * 3 + 1, sizeof *ent);
  ddp_tensor_t *tv = ddp__calloc(nu * 3 + 1, sizeof *tv);
  char(*nm)[48] = ddp__calloc(nu * 3 + 1, sizeof *nm);
  unsigned char **bufs = ddp__calloc(nu * 3 + 1, sizeof *bufs);
  double *steps = ddp__calloc(n ? n : 1, sizeof *steps);
  ddp_status_t st = DDP_OK;
  if (!ent || !tv || !nm || !bufs || !steps) {
    st = ddp__error(err, c.v.rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory saving shards");
    goto out;
  }
  for (size_t ui = 0; ui < nu; ui++) {
    ddp__fsdp_unit_view_t u;
    ddp__fsdp_unit(f, ui, &u);
    int64_t S = (int64_t)u.S;
    snprintf(nm[ui], sizeof nm[ui], "unit.%zu", ui);
    ddp_tensor_view(&tv[ui], c.v.dt, 1, &S, u.shard);
    ent[ui] = (ddp_st_entry_t){nm[ui], &tv[ui]};
  }
  st = ddp_st_write(model_path, ent, nu, keys, vals, 5, err);
  /* the optimizer file: per unit and slot the flat state of this rank's shard (zeros where
   * a piece has no state, and in the padding), and every parameter's step (-1: none) */
  size_t ne = 0;
  for (size_t i = 0; i < n; i++) {
    double s;
    ddp_tensor_t *t[3];
    size_t at;
    steps[i] = c.local[i] != SIZE_MAX && piece_state(&c, i, &s, t, &at) ? s : -1;
  }
  for (size_t ui = 0; st == DDP_OK && ui < nu; ui++) {
    ddp__fsdp_unit_view_t u;
    ddp__fsdp_unit(f, ui, &u);
    int64_t S = (int64_t)u.S;
    for (size_t s = 0; st == DDP_OK && s < ns; s++, ne++) {
      if (!(bufs[ne] = ddp__calloc(u.S, c.v.esz))) {
        st = ddp__error(err, c.v.rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory saving shards");
        break;
      }
      for (size_t k = 0; k < u.np; k++) {
        size_t i = u.idx[k], at;
        double step;
        ddp_tensor_t *t[3];
        if (c.local[i] == SIZE_MAX || !piece_state(&c, i, &step, t, &at) || !t[s]) continue;
        memcpy(bufs[ne] + (at - (size_t)c.v.rank * u.S) * c.v.esz, t[s]->data,
               ddp_tensor_nbytes(t[s]));
      }
      snprintf(nm[ne], sizeof nm[ne], "unit.%zu.%s", ui, names[s]);
      ddp_tensor_view(&tv[ne], c.v.dt, 1, &S, bufs[ne]);
      ent[ne] = (ddp_st_entry_t){nm[ne], &tv[ne]};
    }
  }
  if (st == DDP_OK) {
    int64_t nn = (int64_t)n;
    ddp_tensor_view(&tv[ne], DDP_F64, 1, &nn, steps);
    ent[ne] = (ddp_st_entry_t){"step", &tv[ne]};
    st = ddp_st_write(optim_path, ent, ne + 1, keys, vals, 5, err);
  }
out:
  for (size_t k = 0; bufs && k < nu * 3 + 1; k++) ddp__free(bufs[k]);
  ddp__free(bufs);
  ddp__free(ent);
  ddp__free(tv);
  ddp__free(nm);
  ddp__free(steps);
  ctx_free(&c);
  return st;
}

/* The old shards, opened, checked against this model's units. */
typedef struct old {
  ddp_st_file_t **m, **o;
  const char *const *mp, *const *op;
  int W;
} old_t;

static ddp_status_t check_file(const ctx_t *c, ddp_st_file_t *fl, const char *path, int q,
                               const char *units, const char *np) {
  const char *fmt = ddp_st_meta_get(fl, "format"), *w = ddp_st_meta_get(fl, "world_size");
  const char *r = ddp_st_meta_get(fl, "rank"), *un = ddp_st_meta_get(fl, "unit_numel");
  const char *n = ddp_st_meta_get(fl, "num_params");
  char want[16];
  snprintf(want, sizeof want, "%d", q);
  if (!fmt || strcmp(fmt, FORMAT) != 0 || !w || !r || !un || !n)
    return ddp__error(c->err, c->v.rank, DDP_ERR_INVALID_DATA,
                      "fsdp: %s is not a ZeRO-3 shard (metadata format '%s')", path,
                      fmt ? fmt : "none");
  if (strcmp(r, want) != 0)
    return ddp__error(c->err, c->v.rank, DDP_ERR_INVALID_DATA,
                      "fsdp: %s holds rank %s's shard, expected rank %d's", path, r, q);
  if (strcmp(un, units) != 0 || strcmp(n, np) != 0)
    return ddp__error(c->err, c->v.rank, DDP_ERR_INVALID_DATA,
                      "fsdp: %s was written for another model or wrap policy: units of %s "
                      "elements (%s parameters), this model's %s (%s parameters)",
                      path, un, n, units, np);
  return DDP_OK;
}

/* Copies elements [from, from + len) of unit ui's flat tensor `name` from the old shards
 * into dst. */
static ddp_status_t copy_flat(const ctx_t *c, const old_t *o, bool optim, size_t ui,
                              const char *name, size_t from, size_t len, unsigned char *dst) {
  ddp__fsdp_unit_view_t u;
  ddp__fsdp_unit(c->f, ui, &u);
  size_t W = (size_t)o->W, S = (u.numel + W - 1) / W;
  if (!S) S = 1;
  char nm[64];
  snprintf(nm, sizeof nm, name[0] ? "unit.%zu.%s" : "unit.%zu", ui, name);
  for (size_t p = from; p < from + len;) {
    size_t q = p / S, e = (q + 1) * S < from + len ? (q + 1) * S : from + len;
    ddp_st_file_t *fl = optim ? o->o[q] : o->m[q];
    const char *path = optim ? o->op[q] : o->mp[q];
    size_t idx;
    ddp_tensor_t v;
    if (ddp_st_find(fl, nm, &idx) != DDP_OK || ddp_st_tensor(fl, idx, &v) != DDP_OK ||
        v.dtype != c->v.dt || (size_t)v.numel != S)
      return ddp__error(c->err, c->v.rank, DDP_ERR_INVALID_DATA,
                        "fsdp: %s has no %s[%zu] '%s' (a shard of unit %zu at world size %d)", path,
                        ddp_dtype_name(c->v.dt), S, nm, ui, o->W);
    memcpy(dst + (p - from) * c->v.esz, (unsigned char *)v.data + (p - q * S) * c->v.esz,
           (e - p) * c->v.esz);
    p = e;
  }
  return DDP_OK;
}

ddp_status_t ddp_fsdp_load_sharded(ddp_fsdp_t *f, const char *const *model_paths,
                                   const char *const *optim_paths, int world, ddp_error_t *err) {
  DDP_REQUIRE(f && model_paths && optim_paths && world > 0);
  ctx_t c;
  DDP_CHECK(ctx_init(&c, f, err));
  old_t o = {ddp__calloc((size_t)world, sizeof *o.m), ddp__calloc((size_t)world, sizeof *o.o),
             model_paths, optim_paths, world};
  const char *names[3];
  size_t ns = slots(&c, names);
  char units[8192], w_[16], np[24];
  meta(&c, units, sizeof units, w_, np);
  ddp_status_t st = o.m && o.o
                        ? DDP_OK
                        : ddp__error(err, c.v.rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory");
  for (int q = 0; st == DDP_OK && q < world; q++) {
    st = ddp_st_open(model_paths[q], DDP_ST_READ, &o.m[q], err);
    if (st == DDP_OK) st = ddp_st_open(optim_paths[q], DDP_ST_READ, &o.o[q], err);
    if (st == DDP_OK) st = check_file(&c, o.m[q], model_paths[q], q, units, np);
    if (st == DDP_OK) st = check_file(&c, o.o[q], optim_paths[q], q, units, np);
    const char *wq = st == DDP_OK ? ddp_st_meta_get(o.m[q], "world_size") : NULL;
    if (wq && atoi(wq) != world)
      st = ddp__error(err, c.v.rank, DDP_ERR_INVALID_DATA,
                      "fsdp: %s was written by %s ranks, the checkpoint says %d", model_paths[q],
                      wq, world);
  }
  /* the parameters: this rank's shard of every unit (its padding stays zero) */
  for (size_t ui = 0; st == DDP_OK && ui < c.v.nunits; ui++) {
    ddp__fsdp_unit_view_t u;
    ddp__fsdp_unit(f, ui, &u);
    size_t lo = (size_t)c.v.rank * u.S, hi = lo + u.S < u.numel ? lo + u.S : u.numel;
    memset(u.shard, 0, u.S * c.v.esz);
    if (lo < hi) st = copy_flat(&c, &o, false, ui, "", lo, hi - lo, u.shard);
  }
  /* the optimizer: each piece's state from the old shards that cover it */
  for (size_t i = 0; st == DDP_OK && i < c.v.nparams; i++) {
    if (c.local[i] == SIZE_MAX) continue;
    ddp__fsdp_unit_view_t u;
    ddp__fsdp_unit(f, c.unit[i], &u);
    size_t at, q;
    double step;
    ddp_tensor_t *t[3];
    piece_state(&c, i, &step, t, &at);
    size_t S = (u.numel + (size_t)world - 1) / (size_t)world;
    q = at / (S ? S : 1);
    size_t idx;
    ddp_tensor_t sv;
    if (ddp_st_find(o.o[q], "step", &idx) != DDP_OK || ddp_st_tensor(o.o[q], idx, &sv) != DDP_OK ||
        sv.dtype != DDP_F64 || (size_t)sv.numel != c.v.nparams) {
      st = ddp__error(err, c.v.rank, DDP_ERR_INVALID_DATA, "fsdp: %s has no F64[%zu] 'step'",
                      optim_paths[q], c.v.nparams);
      break;
    }
    memcpy(&step, (const double *)sv.data + i, sizeof step);
    st = ddp_optim_param_state_set(c.v.opt[c.v.group[i]], c.local[i], step >= 0,
                                   step >= 0 ? step : 0, t, err);
    for (size_t s = 0; st == DDP_OK && step >= 0 && s < ns; s++)
      if (t[s])
        st = copy_flat(&c, &o, true, c.unit[i], names[s], at, (size_t)t[s]->numel,
                       (unsigned char *)t[s]->data);
  }
  for (int q = 0; q < world; q++) {
    if (o.m) ddp_st_close(o.m[q]);
    if (o.o) ddp_st_close(o.o[q]);
  }
  ddp__free(o.m);
  ddp__free(o.o);
  ctx_free(&c);
  return st;
}
