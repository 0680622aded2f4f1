/* ZeRO-3 / FSDP FULL_SHARD (include/ddp/shard.h): units from the wrap policy, flat padded
 * shards, the all-gathers around each unit's forward and backward, the reduce-scatter of
 * its gradient when its backward is done, and the optimizer over this rank's pieces.
 *
 * Layout of unit u: its parameters in registration order at offsets off[k] of a flat
 * buffer of `padded` elements (numel rounded up to a multiple of W, the tail zero); rank r
 * owns [r S, (r + 1) S), S = padded / W. Under hybrid sharding (hybrid.c) the shards are
 * over the node's ranks instead: local rank l owns [l S, (l + 1) S), S = padded / L. A parameter
 * meets a rank's shard in at most one contiguous piece; the optimizer of the parameter's group
 * steps that piece (AdamW and the others are elementwise, so a piece steps as the whole parameter
 * would, bit for bit).
 *
 * Numerics (the reason for each choice): the gradient of a unit is reduced once per
 * optimizer step, on the synchronising micro-batch, from the full local gradient summed
 * over the window (FSDP's no_sync keeps unsharded gradients the same way); the divide is
 * DDP's and the reduce-scatter sums in rank order, which is DDP's allreduce element for
 * element. The gradient norm needs each parameter's norm over its whole gradient in
 * element order, so the reduced shards are all-gathered once into the unit's gradient
 * buffer before it is freed (Ψ(W-1)/W more bytes than FSDP's 3Ψ(W-1)/W per step).
 *
 * Prefetch (forward_prefetch, backward_prefetch, limit_all_gathers) issues a unit's
 * all-gather as asynchronous work earlier than its use and waits for it when the unit is
 * needed; the group runs collectives in issue order on every rank, and an all-gather
 * copies, so the bits are those without prefetch. */
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/shard.h"
#include "shard/fsdp_internal.h"

#define FSDP_MAGIC 0x46534450u /* "FSDP" */

typedef struct unit {
  size_t *idx; /* [np] model parameter indices */
  size_t *off; /* [np] element offsets in the flat buffer */
  size_t np;
  size_t numel, padded, S;
  unsigned char *shard;  /* [S] this rank's parameters */
  unsigned char *gshard; /* [S] this rank's reduced gradient; NULL: None */
  unsigned char *full;   /* [padded] gathered parameters; NULL: freed */
  unsigned char *gfull;  /* [padded] full local gradient during backward; NULL: freed */
  bool done;             /* its backward finished in this micro-batch */
  ddp_work_t *work;      /* its parameters' all-gather in flight; NULL: none */
  uint64_t issued;       /* when (issue count) that all-gather was issued */
} unit_t;

struct ddp_fsdp {
  uint32_t magic;
  ddp_pg_t *pg;
  ddp_model_t *model;
  int rank, world;
  ddp_fsdp_options_t opts;
  /* hybrid sharding (hybrid.c): the shards are over the node group hy.node, of ssize
   * ranks, this one its srank-th; without it hy.node is pg, ssize W, srank rank */
  ddp__hybrid_t hy;
  int srank, ssize;
  ddp_dtype_t dt;
  size_t esz;
  size_t nunits;
  unit_t *u;        /* [nunits], u[0] the root */
  size_t *unit_of;  /* [nparams] */
  size_t *blk_unit; /* [nblocks] unit of block k, 0: not wrapped */
  size_t nparams;
  /* the optimizer pieces: one per (parameter, this rank's shard) that meet */
  size_t npieces;
  ddp_tensor_t *pv, *pg_;        /* [npieces] value and gradient views */
  size_t *piece_unit, *piece_at; /* [npieces] unit, element offset in the shard */
  size_t *piece_of;              /* [nparams] piece index, SIZE_MAX: none here */
  size_t ngroups;
  ddp_optim_t *opt[DDP_ZERO_MAX_GROUPS];
  int *group;          /* [nparams] */
  double *norms;       /* [nparams] gradient norms taken at reduction */
  ddp_tensor_t **clip; /* [ntrain] piece gradients or &none, trainable parameters in order */
  size_t ntrain;
  ddp_tensor_t none;
  bool train, sync;
  bool summoned;         /* gather_all holds every unit: the hooks do nothing */
  size_t gathered, peak; /* bytes of full copies held now, and the most since reset */
  /* the forward order of the units (prefetch's "next"): this micro-batch's so far and the
   * previous one's */
  size_t *fwd, nfwd; /* [nunits] units in the order their forward started */
  size_t *pos;       /* [nunits] position in fwd, SIZE_MAX: not yet */
  size_t *fnext;     /* [nunits] next unit in the previous forward order, SIZE_MAX: none */
  size_t inflight;   /* parameter all-gathers issued and not yet waited for */
  uint64_t nissued;
  ddp_error_t *err; /* the running call's, for the hooks */
};

/* ---------------------------------------------------------------- memory ---------- */

static void track(ddp_fsdp_t *f, size_t bytes, bool add) {
  f->gathered = add ? f->gathered + bytes : f->gathered - bytes;
  if (f->gathered > f->peak) f->peak = f->gathered;
}

static void point_params(ddp_fsdp_t *f, unit_t *u, unsigned char *base, bool grads) {
  for (size_t k = 0; k < u->np; k++) {
    ddp_param_t *p = ddp_model_param(f->model, u->idx[k]);
    void *at = base ? base + u->off[k] * f->esz : NULL;
    if (grads)
      p->grad.data = at;
    else
      p->value.data = at;
  }
}

static ddp_status_t no_memory(ddp_fsdp_t *f, size_t bytes, const char *what, size_t unit) {
  return ddp__error(f->err, f->rank, DDP_ERR_NO_MEMORY,
                    "fsdp: out of memory for unit %zu's %s (%zu bytes)", unit, what, bytes);
}

static ddp_status_t coll(ddp_fsdp_t *f, ddp_status_t st, ddp_work_t *w, const char *what,
                         size_t unit) {
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st == DDP_OK) return DDP_OK;
  ddp_error_t pe;
  ddp_pg_last_error_copy(f->pg, &pe);
  return ddp__error_quiet(f->err, st, "fsdp: unit %zu: %s: %s", unit, what, pe.msg);
}

/* The flight recorder's tag for unit ui's next collective: the unit, what the collective
 * is for, and its first parameter names (whole names that fit, then "..."). */
static void tag(ddp_fsdp_t *f, size_t ui, const char *what) {
  if (!ddp_pg_flight_recorder_enabled(f->pg)) return;
  const unit_t *u = &f->u[ui];
  char text[240];
  size_t len = (size_t)snprintf(text, sizeof text, "fsdp unit %zu %s, %zu params: ", ui, what,
                                u->np);
  for (size_t k = 0; k < u->np && len < sizeof text; k++) {
    const char *name = ddp_model_param(f->model, u->idx[k])->name;
    size_t n = strlen(name) + (k ? 1 : 0);
    if (len + n + 5 > sizeof text) {
      snprintf(text + len, sizeof text - len, "%s...", k ? "," : "");
      break;
    }
    len += (size_t)snprintf(text + len, sizeof text - len, "%s%s", k ? "," : "", name);
  }
  ddp_pg_set_next_collective_tag(f->pg, -1, text);
}

static ddp_status_t await(ddp_fsdp_t *f, size_t ui);

/* Issues unit ui's parameter all-gather into a new full buffer (asynchronous; await
 * waits for it and points the parameters at it). Nothing when it is gathered or in
 * flight already. */
static ddp_status_t issue(ddp_fsdp_t *f, size_t ui, const char *what) {
  unit_t *u = &f->u[ui];
  if (u->full) return DDP_OK;
  while (f->opts.limit_all_gathers && f->inflight >= 2) { /* FSDP's rate limiter */
    size_t old = SIZE_MAX;
    for (size_t v = 0; v < f->nunits; v++)
      if (f->u[v].work && (old == SIZE_MAX || f->u[v].issued < f->u[old].issued)) old = v;
    DDP_CHECK(await(f, old));
  }
  size_t bytes = u->padded * f->esz;
  u->full = ddp__aligned_alloc(bytes);
  if (!u->full) return no_memory(f, bytes, "parameter all-gather", ui);
  track(f, bytes, true);
  char full[64];
  snprintf(full, sizeof full, "all_gather (%s)", what);
  if (f->hy.node == f->pg) tag(f, ui, full); /* sub-groups record nothing */
  ddp_status_t st = ddp_allgather(f->hy.node, u->shard, u->full, u->S, f->dt, &u->work);
  if (st != DDP_OK) {
    u->work = NULL;
    return coll(f, st, NULL, "parameter all_gather", ui);
  }
  f->inflight++;
  u->issued = ++f->nissued;
  return DDP_OK;
}

static ddp_status_t await(ddp_fsdp_t *f, size_t ui) {
  unit_t *u = &f->u[ui];
  if (!u->work) return DDP_OK;
  ddp_work_t *w = u->work;
  u->work = NULL;
  f->inflight--;
  DDP_CHECK(coll(f, DDP_OK, w, "parameter all_gather", ui));
  point_params(f, u, u->full, false);
  return DDP_OK;
}

/* All-gathers unit ui's parameters (unless prefetched) and points them at the copy. */
static ddp_status_t gather(ddp_fsdp_t *f, size_t ui, const char *what) {
  DDP_CHECK(issue(f, ui, what));
  return await(f, ui);
}

static void release(ddp_fsdp_t *f, size_t ui) {
  unit_t *u = &f->u[ui];
  if (!u->full) return;
  if (u->work) { /* a prefetch never used: the buffer is the group's until it ends */
    (void)ddp_work_wait_free(u->work); /* a failure is the group's, reported by its user */
    u->work = NULL;
    f->inflight--;
  }
  point_params(f, u, NULL, false);
  ddp__aligned_free(u->full);
  u->full = NULL;
  track(f, u->padded * f->esz, false);
}

/* The unit's full gradient buffer (zeros; kept across no_sync micro-batches). */
static ddp_status_t grads_on(ddp_fsdp_t *f, size_t ui) {
  unit_t *u = &f->u[ui];
  if (!u->gfull) {
    size_t bytes = u->padded * f->esz;
    u->gfull = ddp__aligned_alloc(bytes);
    if (!u->gfull) return no_memory(f, bytes, "gradient", ui);
    memset(u->gfull, 0, bytes);
    track(f, bytes, true);
  }
  point_params(f, u, u->gfull, true);
  return DDP_OK;
}

static void grads_off(ddp_fsdp_t *f, size_t ui) {
  unit_t *u = &f->u[ui];
  point_params(f, u, NULL, true);
  if (!u->gfull) return;
  ddp__aligned_free(u->gfull);
  u->gfull = NULL;
  track(f, u->padded * f->esz, false);
}

/* A unit smaller than persistence_threshold: kept gathered while training. */
static bool persistent(const ddp_fsdp_t *f, size_t ui) {
  return f->train && (int64_t)f->u[ui].numel < f->opts.persistence_threshold;
}

/* ---------------------------------------------------------------- reduction ------- */

/* Unit ui's backward is done: on a synchronising micro-batch its gradient is divided,
 * reduce-scattered into the shard, all-gathered back for the norms, and freed; otherwise
 * kept for the next micro-batch. Its parameters are freed either way. */
static ddp_status_t finish_unit(ddp_fsdp_t *f, size_t ui) {
  unit_t *u = &f->u[ui];
  if (u->done) return DDP_OK;
  u->done = true;
  if (f->sync && u->gfull) {
    size_t bytes = u->S * f->esz;
    if (!u->gshard && !(u->gshard = ddp__aligned_alloc(bytes)))
      return no_memory(f, bytes, "gradient shard", ui);
    ddp_work_t *w = NULL;
    ddp_status_t st = DDP_OK;
    if (f->hy.replica) { /* hybrid.c: DDP's order, or FSDP's two stages */
      bool fsdp = f->opts.arith == DDP_GRAD_ARITH_FSDP1 || f->opts.arith == DDP_GRAD_ARITH_FSDP2;
      if (!fsdp) tag(f, ui, "reduce_scatter (gradient, all ranks)");
      st = ddp__hybrid_reduce(&f->hy, f->opts.arith, f->opts.divide_in_place, u->gfull, u->gshard,
                              u->padded, f->dt, f->err);
      if (st != DDP_OK) {
        ddp_error_t why = f->err ? *f->err : (ddp_error_t){st, ""};
        return ddp__error_quiet(f->err, st, "fsdp: unit %zu: %s", ui, why.msg);
      }
    } else {
      ddp_grad_arith_pre(f->opts.arith, f->world, f->opts.divide_in_place, u->gfull, u->gfull,
                         u->padded, f->dt);
      tag(f, ui, "reduce_scatter (gradient)");
      st = ddp_reduce_scatter(f->pg, u->gfull, u->gshard, u->S, f->dt, DDP_OP_SUM, &w);
      DDP_CHECK(coll(f, st, w, "gradient reduce_scatter", ui));
      ddp_grad_arith_post(f->opts.arith, f->world, u->gshard, u->S, f->dt);
    }
    if (f->hy.node == f->pg) tag(f, ui, "all_gather (gradient, for the norm)");
    st = ddp_allgather(f->hy.node, u->gshard, u->gfull, u->S, f->dt, &w);
    DDP_CHECK(coll(f, st, w, "gradient all_gather for the norm", ui));
    for (size_t k = 0; k < u->np; k++) {
      ddp_param_t *p = ddp_model_param(f->model, u->idx[k]);
      ddp_tensor_t g = p->value;
      g.data = u->gfull + u->off[k] * f->esz;
      f->norms[u->idx[k]] = ddp_grad_arith_param_norm(f->opts.arith, f->rank, f->world, &g);
    }
    for (size_t q = 0; q < f->npieces; q++)
      if (f->piece_unit[q] == ui) f->pg_[q].data = u->gshard + f->piece_at[q] * f->esz;
  }
  if (f->sync || !f->train)
    grads_off(f, ui);
  else
    point_params(f, u, NULL, true);
  if (f->sync || !persistent(f, ui)) release(f, ui);
  return DDP_OK;
}

/* ---------------------------------------------------------------- hooks ----------- */

static ddp_status_t pre_forward(void *user, size_t block) {
  ddp_fsdp_t *f = user;
  size_t ui = f->blk_unit[block];
  if (!ui || f->summoned) return DDP_OK;
  if (f->pos[ui] == SIZE_MAX) {
    f->pos[ui] = f->nfwd;
    f->fwd[f->nfwd++] = ui;
  }
  DDP_CHECK(issue(f, ui, "forward"));
  if (f->opts.forward_prefetch && f->fnext[ui] != SIZE_MAX)
    DDP_CHECK(issue(f, f->fnext[ui], "forward prefetch"));
  return await(f, ui);
}

/* The unit after ui in backward order: the one before it in this forward's order. */
static size_t backward_next(const ddp_fsdp_t *f, size_t ui) {
  size_t p = f->pos[ui];
  return p != SIZE_MAX && p > 0 ? f->fwd[p - 1] : SIZE_MAX;
}

static ddp_status_t post_forward(void *user, size_t block) {
  ddp_fsdp_t *f = user;
  size_t ui = f->blk_unit[block];
  if (ui && !f->summoned && !persistent(f, ui) && (f->opts.reshard_after_forward || !f->train))
    release(f, ui);
  return DDP_OK;
}

static ddp_status_t pre_backward(void *user, size_t block) {
  ddp_fsdp_t *f = user;
  size_t ui = f->blk_unit[block];
  if (!ui) return DDP_OK;
  DDP_CHECK(issue(f, ui, "backward"));
  size_t next = backward_next(f, ui);
  if (f->opts.backward_prefetch == DDP_FSDP_BACKWARD_PRE && next != SIZE_MAX)
    DDP_CHECK(issue(f, next, "backward_pre prefetch"));
  DDP_CHECK(await(f, ui));
  return grads_on(f, ui);
}

static ddp_status_t post_backward(void *user, size_t block) {
  ddp_fsdp_t *f = user;
  size_t ui = f->blk_unit[block];
  if (!ui) return DDP_OK;
  size_t next = backward_next(f, ui);
  if (f->opts.backward_prefetch == DDP_FSDP_BACKWARD_POST && next != SIZE_MAX &&
      !f->u[ui].done) { /* FSDP's order: free this unit, gather the next, then reduce */
    release(f, ui);
    DDP_CHECK(issue(f, next, "backward_post prefetch"));
  }
  return finish_unit(f, ui);
}

/* ---------------------------------------------------------------- create ---------- */

/* Whether cls is one of the names in list (comma or space separated). */
static bool listed(const char *list, const char *cls) {
  size_t n = strlen(cls);
  for (const char *s = list; *s;) {
    while (*s == ',' || *s == ' ') s++;
    size_t k = strcspn(s, ", ");
    if (k == n && !strncmp(s, cls, n)) return true;
    s += k;
  }
  return false;
}

/* The wrap policy: blk_unit[k] for every block; every listed class must name a block. */
static ddp_status_t policy(ddp_fsdp_t *f, size_t nb, size_t *nunits) {
  const char *wc = f->opts.wrap_cls ? f->opts.wrap_cls : "";
  *nunits = 1;
  for (size_t k = 0; k < nb; k++) {
    const char *cls;
    size_t first, count;
    ddp_model_block(f->model, k, &cls, &first, &count);
    int64_t numel = 0;
    for (size_t i = first; i < first + count; i++)
      numel += ddp_model_param(f->model, i)->value.numel;
    bool wrap = (wc[0] && listed(wc, cls)) ||
                (f->opts.min_num_params > 0 && numel >= f->opts.min_num_params);
    f->blk_unit[k] = wrap ? (*nunits)++ : 0;
  }
  char name[128];
  for (const char *s = wc; *s;) {
    while (*s == ',' || *s == ' ') s++;
    size_t k = strcspn(s, ", ");
    if (!k) break;
    snprintf(name, sizeof name, "%.*s", (int)k, s);
    bool found = false;
    char have[512] = "";
    size_t hl = 0;
    for (size_t b = 0; b < nb && !found; b++) {
      const char *cls;
      ddp_model_block(f->model, b, &cls, NULL, NULL);
      found = !strcmp(cls, name);
      if (!strstr(have, cls) && hl + strlen(cls) + 3 < sizeof have)
        hl += (size_t)snprintf(have + hl, sizeof have - hl, "%s%s", hl ? ", " : "", cls);
    }
    if (!found)
      return ddp__error(f->err, f->rank, DDP_ERR_INVALID_ARGUMENT,
                        "fsdp: transformer_layer_cls_to_wrap names '%s', which is no module of "
                        "the model (its wrappable modules: %s)",
                        name, hl ? have : "none");
    s += k;
  }
  return DDP_OK;
}

/* Units, their layouts and shards (copied from the model's storage, then released). */
static ddp_status_t layout(ddp_fsdp_t *f) {
  size_t n = f->nparams, W = (size_t)f->world;
  for (size_t i = 0; i < n; i++) f->u[f->unit_of[i]].np++;
  /* padded to a multiple of W (hybrid.c cuts it into W pieces); each of the ssize ranks of
   * the node group holds padded / ssize (W / ssize pieces; one without hybrid) */
  for (size_t ui = 0; ui < f->nunits; ui++) {
    unit_t *u = &f->u[ui];
    u->idx = ddp__calloc(u->np ? u->np : 1, sizeof *u->idx);
    u->off = ddp__calloc(u->np ? u->np : 1, sizeof *u->off);
    if (!u->idx || !u->off) return no_memory(f, u->np * 2 * sizeof(size_t), "layout", ui);
    u->np = 0;
  }
  for (size_t i = 0; i < n; i++) {
    unit_t *u = &f->u[f->unit_of[i]];
    u->idx[u->np] = i;
    u->off[u->np++] = u->numel;
    u->numel += (size_t)ddp_model_param(f->model, i)->value.numel;
  }
  for (size_t ui = 0; ui < f->nunits; ui++) {
    unit_t *u = &f->u[ui];
    size_t P = (u->numel + W - 1) / W;
    if (!P) P = 1;
    u->padded = P * W;
    u->S = u->padded / (size_t)f->ssize;
    u->shard = ddp__aligned_alloc(u->S * f->esz);
    if (!u->shard) return no_memory(f, u->S * f->esz, "parameter shard", ui);
    memset(u->shard, 0, u->S * f->esz);
    size_t lo = (size_t)f->srank * u->S, hi = lo + u->S;
    for (size_t k = 0; k < u->np; k++) {
      const ddp_param_t *p = ddp_model_param(f->model, u->idx[k]);
      size_t a = u->off[k], b = a + (size_t)p->value.numel;
      size_t s = a > lo ? a : lo, e = b < hi ? b : hi;
      if (s < e)
        memcpy(u->shard + (s - lo) * f->esz,
               (const unsigned char *)p->value.data + (s - a) * f->esz, (e - s) * f->esz);
    }
  }
  return DDP_OK;
}

/* The pieces of this rank's shards and the optimizers over them. */
static ddp_status_t pieces(ddp_fsdp_t *f, const ddp_optim_options_t *gopts) {
  size_t n = f->nparams;
  f->pv = ddp__calloc(n ? n : 1, sizeof *f->pv);
  f->pg_ = ddp__calloc(n ? n : 1, sizeof *f->pg_);
  f->piece_unit = ddp__calloc(n ? n : 1, sizeof *f->piece_unit);
  f->piece_at = ddp__calloc(n ? n : 1, sizeof *f->piece_at);
  ddp_optim_param_t *mine = ddp__calloc(n ? n : 1, sizeof *mine);
  if (!f->pv || !f->pg_ || !f->piece_unit || !f->piece_at || !mine) {
    ddp__free(mine);
    return no_memory(f, n * sizeof *f->pv, "optimizer pieces", 0);
  }
  for (size_t i = 0; i < n; i++) {
    f->piece_of[i] = SIZE_MAX;
    unit_t *u = &f->u[f->unit_of[i]];
    size_t k = 0;
    while (u->idx[k] != i) k++;
    const ddp_param_t *p = ddp_model_param(f->model, i);
    size_t lo = (size_t)f->srank * u->S, hi = lo + u->S;
    size_t a = u->off[k], b = a + (size_t)p->value.numel;
    size_t s = a > lo ? a : lo, e = b < hi ? b : hi;
    if (s >= e) continue;
    size_t q = f->npieces++;
    int64_t len = (int64_t)(e - s);
    ddp_tensor_view(&f->pv[q], f->dt, 1, &len, u->shard + (s - lo) * f->esz);
    f->pg_[q] = f->pv[q];
    f->pg_[q].data = NULL; /* None until the first reduction */
    f->piece_unit[q] = f->unit_of[i];
    f->piece_at[q] = s - lo;
    f->piece_of[i] = q;
  }
  ddp_status_t st = DDP_OK;
  for (size_t g = 0; g < f->ngroups && st == DDP_OK; g++) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
      if (f->group[i] == (int)g && f->piece_of[i] != SIZE_MAX)
        mine[m++] = (ddp_optim_param_t){&f->pv[f->piece_of[i]], &f->pg_[f->piece_of[i]]};
    st = ddp_optim_create(&gopts[g], mine, m, &f->opt[g], f->err);
  }
  ddp__free(mine);
  return st;
}

ddp_status_t ddp_fsdp_create(ddp_pg_t *pg, ddp_model_t *model, const ddp_fsdp_options_t *opts,
                             const ddp_optim_options_t *gopts, const int *group, size_t ngroups,
                             ddp_fsdp_t **out, ddp_error_t *err) {
  DDP_REQUIRE(pg && model && opts && out && group && (gopts || ngroups == 0));
  DDP_REQUIRE(opts->struct_size >= sizeof(ddp_fsdp_options_t));
  *out = NULL;
  int rank = ddp_pg_rank(pg);
  size_t n = ddp_model_num_params(model);
  if (!strcmp(ddp_grad_arith_name(opts->arith), "?"))
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "fsdp: gradient arithmetic %d is not one of " DDP_GRAD_ARITH_CHOICES,
                      (int)opts->arith);
  if (ngroups > DDP_ZERO_MAX_GROUPS)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "fsdp: %zu parameter groups; at most %d",
                      ngroups, DDP_ZERO_MAX_GROUPS);
  ddp_dtype_t dt = n ? ddp_model_param(model, 0)->value.dtype : DDP_F32;
  for (size_t i = 0; i < n; i++) {
    ddp_dtype_t d = ddp_model_param(model, i)->value.dtype;
    if ((d != DDP_F32 && d != DDP_F64) || d != dt)
      return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                        "fsdp: parameter %s is %s; ZeRO-3 takes all-f32 or all-f64 parameters",
                        ddp_model_param(model, i)->name, ddp_dtype_name(d));
  }
  ddp_fsdp_t *f = ddp__calloc(1, sizeof *f);
  if (!f) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory");
  *f = (ddp_fsdp_t){.magic = FSDP_MAGIC,
                    .pg = pg,
                    .model = model,
                    .rank = rank,
                    .world = ddp_pg_size(pg),
                    .opts = *opts,
                    .dt = dt,
                    .esz = ddp_dtype_size(dt),
                    .nparams = n,
                    .ngroups = ngroups,
                    .err = err};
  f->none.dtype = dt;
  f->hy = (ddp__hybrid_t){pg, pg, NULL, f->world, f->world, 1, 0, rank};
  ddp_status_t st = ddp__hybrid_create(pg, opts->shard_size, &f->hy, err);
  if (st != DDP_OK) goto fail;
  f->srank = f->hy.l;
  f->ssize = f->hy.L;
  size_t nb = ddp_model_num_blocks(model), n1 = n ? n : 1;
  f->blk_unit = ddp__calloc(nb ? nb : 1, sizeof *f->blk_unit);
  f->unit_of = ddp__calloc(n1, sizeof *f->unit_of);
  f->piece_of = ddp__calloc(n1, sizeof *f->piece_of);
  f->group = ddp__calloc(n1, sizeof *f->group);
  f->norms = ddp__calloc(n1, sizeof *f->norms);
  f->clip = ddp__calloc(n1, sizeof *f->clip);
  f->fwd = ddp__calloc(nb + 1, sizeof *f->fwd);
  f->pos = ddp__calloc(nb + 1, sizeof *f->pos);
  f->fnext = ddp__calloc(nb + 1, sizeof *f->fnext);
  if (!f->blk_unit || !f->unit_of || !f->piece_of || !f->group || !f->norms || !f->clip ||
      !f->fwd || !f->pos || !f->fnext) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory (%zu parameters)", n);
    goto fail;
  }
  memcpy(f->group, group, n * sizeof *group);
  DDP_CHECK_GOTO(policy(f, nb, &f->nunits), st, fail);
  for (size_t ui = 0; ui <= nb; ui++) f->pos[ui] = f->fnext[ui] = SIZE_MAX;
  for (size_t k = 0; k < nb; k++) {
    size_t first, count;
    ddp_model_block(model, k, NULL, &first, &count);
    for (size_t i = first; i < first + count; i++) f->unit_of[i] = f->blk_unit[k];
  }
  f->u = ddp__calloc(f->nunits, sizeof *f->u);
  if (!f->u) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory (%zu units)", f->nunits);
    goto fail;
  }
  DDP_CHECK_GOTO(layout(f), st, fail);
  DDP_CHECK_GOTO(pieces(f, gopts), st, fail);
  for (size_t i = 0; i < n; i++)
    if (ddp_model_param(model, i)->requires_grad)
      f->clip[f->ntrain++] = f->piece_of[i] != SIZE_MAX ? &f->pg_[f->piece_of[i]] : &f->none;
  ddp_model_release_storage(model);
  ddp_block_hooks_t h = {f, pre_forward, post_forward, pre_backward, post_backward};
  ddp_model_set_block_hooks(model, &h);
  f->err = NULL;
  *out = f;
  return DDP_OK;
fail:
  ddp_fsdp_destroy(f);
  return st;
}

void ddp_fsdp_destroy(ddp_fsdp_t *f) {
  if (!f) return;
  DDP_REQUIRE(f->magic == FSDP_MAGIC);
  if (f->u) ddp_model_set_block_hooks(f->model, NULL);
  for (size_t ui = 0; f->u && ui < f->nunits; ui++) {
    unit_t *u = &f->u[ui];
    if (u->full) release(f, ui);
    if (u->gfull) grads_off(f, ui);
    ddp__free(u->idx);
    ddp__free(u->off);
    ddp__aligned_free(u->shard);
    ddp__aligned_free(u->gshard);
  }
  for (size_t g = 0; g < f->ngroups; g++) ddp_optim_destroy(f->opt[g]);
  if (f->hy.world) ddp__hybrid_destroy(&f->hy);
  ddp__free(f->u);
  ddp__free(f->blk_unit);
  ddp__free(f->unit_of);
  ddp__free(f->piece_of);
  ddp__free(f->group);
  ddp__free(f->norms);
  ddp__free(f->clip);
  ddp__free(f->fwd);
  ddp__free(f->pos);
  ddp__free(f->fnext);
  ddp__free(f->pv);
  ddp__free(f->pg_);
  ddp__free(f->piece_unit);
  ddp__free(f->piece_at);
  f->magic = 0;
  ddp__free(f);
}

size_t ddp_fsdp_num_units(const ddp_fsdp_t *f) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  return f->nunits;
}

size_t ddp_fsdp_unit_of(const ddp_fsdp_t *f, size_t i) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC && i < f->nparams);
  return f->unit_of[i];
}

/* fsdp_internal.h: the handle as the checkpoint code (fsdp_state.c) sees it */
void ddp__fsdp_view(ddp_fsdp_t *f, ddp__fsdp_view_t *v) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC && v);
  /* the checkpoint code sees the shard group: the node group under hybrid sharding */
  *v = (ddp__fsdp_view_t){f->hy.node,  f->model,    f->srank,   f->ssize,   f->dt,
                          f->esz,      f->nunits,   f->nparams, f->ngroups, f->group,
                          f->piece_of, f->piece_at, f->opt};
}

void ddp__fsdp_unit(ddp_fsdp_t *f, size_t ui, ddp__fsdp_unit_view_t *u) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC && ui < f->nunits && u);
  const unit_t *x = &f->u[ui];
  *u = (ddp__fsdp_unit_view_t){x->idx, x->off, x->np, x->numel, x->S, x->shard};
}

/* ---------------------------------------------------------------- the step -------- */

ddp_status_t ddp_fsdp_begin(ddp_fsdp_t *f, bool train, bool sync, ddp_error_t *err) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  f->err = err;
  f->train = train;
  f->sync = sync && train;
  for (size_t ui = 0; ui < f->nunits; ui++) {
    f->u[ui].done = false;
    f->fnext[ui] = f->pos[ui] = SIZE_MAX;
  }
  /* the previous forward's order is forward_prefetch's guess at this one's */
  for (size_t p = 0; p + 1 < f->nfwd; p++) f->fnext[f->fwd[p]] = f->fwd[p + 1];
  f->nfwd = 0;
  ddp_status_t st = gather(f, 0, "root");
  if (st == DDP_OK && train) st = grads_on(f, 0);
  /* Units kept with their gradients over no_sync micro-batches point at them again when
   * their backward starts (pre_backward). */
  return st;
}

ddp_status_t ddp_fsdp_end(ddp_fsdp_t *f, ddp_error_t *err) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  f->err = err;
  ddp_status_t st = DDP_OK;
  /* Units whose input needed no gradient had no post_backward: finish them, last first
   * (backward order), then the root. */
  for (size_t ui = f->nunits; ui-- > 1 && st == DDP_OK;)
    if (f->train && (f->u[ui].full || f->u[ui].gfull) && !f->u[ui].done) st = finish_unit(f, ui);
  if (st == DDP_OK && f->train) st = finish_unit(f, 0);
  for (size_t ui = 0; ui < f->nunits; ui++)
    if (f->sync || !persistent(f, ui)) release(f, ui); /* persistent: to the window's end */
  return st;
}

/* --sharding_arithmetic's clipping (arith.c): FSDP1's over each unit's flat gradient
 * shard, FSDP2's and DeepSpeed ZeRO-3's over the norms finish_unit took of each
 * parameter's shard in their layouts. */
static ddp_status_t clip_framework(ddp_fsdp_t *f, double max_norm, double *total_norm,
                                   ddp_error_t *err) {
  ddp_grad_arith_t a = f->opts.arith;
  bool ds = a == DDP_GRAD_ARITH_DEEPSPEED || a == DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE;
  size_t m = 0, cap = ds ? f->ngroups : a == DDP_GRAD_ARITH_FSDP1 ? f->nunits : f->ntrain;
  double *v = ddp__calloc(cap ? cap : 1, sizeof *v);
  if (!v) return ddp__error(err, f->rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory");
  for (size_t ui = 0; a == DDP_GRAD_ARITH_FSDP1 && ui < f->nunits; ui++)
    if (f->u[ui].gshard) v[m++] = ddp_grad_arith_norm(f->u[ui].gshard, f->u[ui].S, f->dt, false);
  for (size_t i = 0; a != DDP_GRAD_ARITH_FSDP1 && i < f->nparams; i++) {
    if (!ddp_model_param(f->model, i)->requires_grad) continue;
    if (!ds)
      v[m++] = f->norms[i];
    else if (f->group[i] >= 0) /* each optimizer group is a sub-group */
      v[f->group[i]] += f->norms[i] * f->norms[i];
  }
  ddp_status_t st = ds ? ddp_grad_arith_clip_deepspeed3(f->pg, v, f->ngroups, f->clip, f->ntrain,
                                                        max_norm, total_norm, err)
                       : ddp_grad_arith_clip_sharded(f->pg, v, m, f->clip, f->ntrain, f->dt,
                                                     max_norm, total_norm, err);
  ddp__free(v);
  return st;
}

ddp_status_t ddp_fsdp_clip_grad_norm(ddp_fsdp_t *f, double max_norm, double *total_norm,
                                     ddp_error_t *err) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC && total_norm);
  if (f->opts.arith != DDP_GRAD_ARITH_DDP) return clip_framework(f, max_norm, total_norm, err);
  double *norms = ddp__calloc(f->ntrain ? f->ntrain : 1, sizeof *norms);
  if (!norms) return ddp__error(err, f->rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory");
  for (size_t i = 0, t = 0; i < f->nparams; i++)
    if (ddp_model_param(f->model, i)->requires_grad) norms[t++] = f->norms[i];
  ddp_clip_grad_norm_from_norms(f->clip, f->ntrain, norms, f->dt, max_norm, total_norm);
  ddp__free(norms);
  return DDP_OK;
}

ddp_status_t ddp_fsdp_step(ddp_fsdp_t *f, double lr, ddp_error_t *err) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  for (size_t g = 0; g < f->ngroups; g++) {
    ddp_optim_set_lr(f->opt[g], lr);
    DDP_CHECK(ddp_optim_step(f->opt[g], err));
  }
  return DDP_OK;
}

void ddp_fsdp_zero_grad(ddp_fsdp_t *f) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  for (size_t q = 0; q < f->npieces; q++) f->pg_[q].data = NULL;
  for (size_t ui = 0; ui < f->nunits; ui++) {
    ddp__aligned_free(f->u[ui].gshard);
    f->u[ui].gshard = NULL;
  }
  memset(f->norms, 0, f->nparams * sizeof *f->norms);
}

ddp_status_t ddp_fsdp_gather_all(ddp_fsdp_t *f, ddp_error_t *err) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  f->err = err;
  for (size_t ui = 0; ui < f->nunits; ui++) DDP_CHECK(gather(f, ui, "summon_full_params"));
  f->summoned = true;
  return DDP_OK;
}

void ddp_fsdp_free_all(ddp_fsdp_t *f) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  for (size_t ui = 0; ui < f->nunits; ui++) release(f, ui);
  f->summoned = false;
}

void ddp_fsdp_state_bytes(ddp_fsdp_t *f, size_t *param_bytes, size_t *grad_bytes,
                          size_t *optim_bytes, size_t *peak_gathered_bytes) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  size_t pb = 0, gb = 0, ob = 0;
  for (size_t q = 0; q < f->npieces; q++) {
    pb += (size_t)f->pv[q].numel * f->esz;
    if (f->pg_[q].data) gb += (size_t)f->pg_[q].numel * f->esz;
  }
  for (size_t g = 0; g < f->ngroups; g++) ob += ddp_optim_state_bytes(f->opt[g]);
  if (param_bytes) *param_bytes = pb;
  if (grad_bytes) *grad_bytes = gb;
  if (optim_bytes) *optim_bytes = ob;
  if (peak_gathered_bytes) *peak_gathered_bytes = f->peak;
  f->peak = f->gathered;
}

ddp_status_t ddp_fsdp_unshard(ddp_fsdp_t *f, ddp_error_t *err) {
  DDP_REQUIRE(f && f->magic == FSDP_MAGIC);
  DDP_CHECK(ddp_fsdp_gather_all(f, err));
  void **at = ddp__calloc(f->nparams ? f->nparams : 1, sizeof *at);
  if (!at) return ddp__error(err, f->rank, DDP_ERR_NO_MEMORY, "fsdp: out of memory");
  for (size_t i = 0; i < f->nparams; i++) at[i] = ddp_model_param(f->model, i)->value.data;
  ddp_status_t st = ddp_model_restore_storage(f->model);
  if (st != DDP_OK) {
    ddp__free(at);
    return ddp__error(err, f->rank, st, "fsdp: out of memory restoring the model's storage");
  }
  /* restore pointed the parameters at the model's buffers: copy the gathered values in */
  for (size_t i = 0; i < f->nparams; i++) {
    ddp_param_t *p = ddp_model_param(f->model, i);
    memcpy(p->value.data, at[i], ddp_tensor_nbytes(&p->value));
  }
  ddp__free(at);
  for (size_t ui = 0; ui < f->nunits; ui++) {
    unit_t *u = &f->u[ui];
    ddp__aligned_free(u->full);
    u->full = NULL;
  }
  f->gathered = 0;
  f->summoned = false;
  ddp_model_set_block_hooks(f->model, NULL);
  return DDP_OK;
}
