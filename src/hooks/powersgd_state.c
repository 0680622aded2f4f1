/* PowerSGD's state (PowerSGDState): creation from the options, the counters, the per-bucket
 * memories (error feedback, warm-start P and Q, the layout they were built for), and
 * save/load of all of it for checkpoints (format "libddp-powersgd-1"). The hooks' maths
 * are in powersgd.c and powersgd_batched.c. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/io.h"
#include "powersgd_internal.h"

ddp_status_t ddp_powersgd_state_create(const ddp_powersgd_options_t *opts, int rank,
                                       ddp_powersgd_state_t **out, ddp_error_t *err) {
  DDP_REQUIRE(out);
  *out = NULL;
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts); /* opts may be NULL */
  if ((o.use_error_feedback || o.warm_start) && o.start_powerSGD_iter <= 1)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or "
                      "`warm_start` is enabled, because PowerSGD can only be applied after "
                      "the first two iterations in DDP.");
  if (o.matrix_approximation_rank < 1)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "PowerSGD: matrix_approximation_rank must be >= 1, got %" PRId64,
                      o.matrix_approximation_rank);
  if (!(o.orthogonalization_epsilon >= 0) || !isfinite(o.min_compression_rate))
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "PowerSGD: orthogonalization_epsilon must be >= 0 and "
                      "min_compression_rate finite");
  ddp_powersgd_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "PowerSGD: out of memory");
  s->magic = PSGD_MAGIC;
  s->o = o;
  if (s->o.compression_stats_logging_frequency < 1) s->o.compression_stats_logging_frequency = 1;
  s->rank = rank;
  ddp__log(rank, DDP_LOG_INFO,
           "PowerSGD config: matrix_approximation_rank = %" PRId64
           "; start_powerSGD_iter = %" PRId64 "; min_compression_rate = %g; "
           "orthogonalization_epsilon = %g; use_error_feedback = %d; warm_start = %d; "
           "random_seed = %" PRIu64 "; compression_stats_logging_frequency = %" PRId64
           "; batch_tensors_with_same_shape = %d",
           o.matrix_approximation_rank, o.start_powerSGD_iter, o.min_compression_rate,
           o.orthogonalization_epsilon, o.use_error_feedback, o.warm_start, o.random_seed,
           s->o.compression_stats_logging_frequency, o.batch_tensors_with_same_shape);
  *out = s;
  return DDP_OK;
}

/* Drops the warm-start memories (P, Q). */
void ddp__psgd_mem_clear(psgd_mem_t *m) {
  ddp__free(m->p);
  ddp__free(m->q);
  m->p = m->q = NULL;
  m->np = m->nq = 0;
  m->has_mem = false;
}

/* The bucket's layout changed: its error feedback and warm-start factors no longer fit. */
void ddp__psgd_mem_restart(psgd_mem_t *m, int rank, size_t bucket) {
  ddp__log(rank, DDP_LOG_WARN,
           "PowerSGD: bucket %zu now holds other tensors than its error feedback and "
           "warm-start memories were built for; they restart from zero",
           bucket);
  ddp__psgd_mem_clear(m);
  ddp__free(m->error);
  m->error = NULL;
  m->nerror = 0;
}

/* Frees everything a bucket's memory holds. */
void ddp__psgd_mem_free(psgd_mem_t *m) {
  ddp__psgd_mem_clear(m);
  ddp__free(m->error);
  ddp__free(m->lay);
  m->error = NULL;
  m->lay = NULL;
  m->nerror = m->nlay = 0;
}

void ddp_powersgd_state_destroy(ddp_powersgd_state_t *s) {
  if (!s) return;
  DDP_REQUIRE(s->magic == PSGD_MAGIC);
  for (size_t i = 0; i < s->nmem; i++) ddp__psgd_mem_free(&s->mem[i]);
  ddp__free(s->mem);
  s->magic = 0;
  ddp__free(s);
}

int64_t ddp_powersgd_iter(const ddp_powersgd_state_t *s) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  return s->iter;
}

int64_t ddp_powersgd_num_allreduces(const ddp_powersgd_state_t *s) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  return s->nallreduce;
}

uint64_t ddp_powersgd_draws(const ddp_powersgd_state_t *s) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  return s->draws;
}

void ddp_powersgd_set_init_q(ddp_powersgd_state_t *s,
                             void (*init_q)(void *user, uint64_t draw, size_t bucket_index,
                                            float *q, size_t n),
                             void *init_q_user) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  s->o.init_q = init_q;
  s->o.init_q_user = init_q_user;
}

void ddp_powersgd_stats(void *state, ddp_comm_hook_stats_t *out) {
  ddp_powersgd_state_t *s = state;
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && out);
  out->numel_before = s->total_before;
  out->numel_after = s->total_after;
  out->bytes_last_step = s->bytes_step;
}

psgd_mem_t *ddp__psgd_get_mem(ddp_powersgd_state_t *s, size_t idx) {
  if (idx >= s->nmem) {
    psgd_mem_t *m = ddp__calloc(idx + 1, sizeof *m);
    if (!m) return NULL;
    if (s->nmem) memcpy(m, s->mem, s->nmem * sizeof *m);
    ddp__free(s->mem);
    s->mem = m;
    s->nmem = idx + 1;
  }
  return &s->mem[idx];
}

/* ---------------------------------------------------------------- save / load ----- */

/* The state file: per bucket b, "bucket.<b>.error" (the error feedback, f32 [nerror]) when
 * it exists, and "bucket.<b>.p" / "bucket.<b>.q" (the warm-start memories, f32) when they
 * hold values; the counters and the options that shape the state in the metadata. Every
 * field that a later hook call reads is here, so a loaded state continues bit for bit. */
#define PSGD_FORMAT "libddp-powersgd-1"
_Static_assert(sizeof(size_t) == sizeof(int64_t), "layouts are stored as i64");
#define PSGD_NMETA 13

static void meta_i64(char *buf, size_t cap, int64_t v) { snprintf(buf, cap, "%" PRId64, v); }

ddp_status_t ddp_powersgd_state_save(const ddp_powersgd_state_t *s, const char *path,
                                     ddp_error_t *err) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && path);
  size_t cap = 4 * s->nmem + 1, n = 0;
  ddp_st_entry_t *e = ddp__calloc(cap, sizeof *e);
  ddp_tensor_t *t = ddp__calloc(cap, sizeof *t);
  char(*names)[48] = ddp__calloc(cap, sizeof *names);
  ddp_status_t st = DDP_OK;
  if (!e || !t || !names) {
    st = ddp__error(err, s->rank, DDP_ERR_NO_MEMORY, "PowerSGD state save: out of memory");
    goto out;
  }
  for (size_t b = 0; b < s->nmem && st == DDP_OK; b++) {
    const psgd_mem_t *m = &s->mem[b];
    struct {
      const char *what;
      float *data;
      size_t len;
      bool present;
    } parts[3] = {{"error", m->error, m->nerror, m->error != NULL},
                  {"p", m->p, m->np, m->has_mem},
                  {"q", m->q, m->nq, m->has_mem}};
    for (int k = 0; k < 3 && st == DDP_OK; k++) {
      if (!parts[k].present) continue;
      int64_t len = (int64_t)parts[k].len;
      snprintf(names[n], sizeof names[n], "bucket.%zu.%s", b, parts[k].what);
      st = ddp_tensor_view(&t[n], DDP_F32, 1, &len, parts[k].data);
      e[n].name = names[n];
      e[n].tensor = &t[n];
      n++;
    }
    if (st == DDP_OK && m->nlay) {
      /* Stored as i64: size_t and int64_t have one size on the (LP64) platforms libddp
       * builds for (checked below), and the values are small. */
      int64_t shape[2] = {(int64_t)m->nlay, 4};
      snprintf(names[n], sizeof names[n], "bucket.%zu.layout", b);
      st = ddp_tensor_view(&t[n], DDP_I64, 2, shape, m->lay);
      e[n].name = names[n];
      e[n].tensor = &t[n];
      n++;
    }
  }
  if (st != DDP_OK) {
    st = ddp__error(err, s->rank, st, "PowerSGD state save %s: bad tensor view", path);
    goto out;
  }
  {
    static const char *const keys[PSGD_NMETA] = {"format",
                                                 "iter",
                                                 "draws",
                                                 "total_numel_before_compression",
                                                 "total_numel_after_compression",
                                                 "next_stats_report",
                                                 "num_allreduces",
                                                 "buckets",
                                                 "matrix_approximation_rank",
                                                 "start_powerSGD_iter",
                                                 "use_error_feedback",
                                                 "warm_start",
                                                 "random_seed"};
    char v[PSGD_NMETA][32];
    snprintf(v[0], sizeof v[0], "%s", PSGD_FORMAT);
    meta_i64(v[1], sizeof v[1], s->iter);
    snprintf(v[2], sizeof v[2], "%" PRIu64, s->draws);
    meta_i64(v[3], sizeof v[3], s->total_before);
    meta_i64(v[4], sizeof v[4], s->total_after);
    meta_i64(v[5], sizeof v[5], s->next_stats_report);
    meta_i64(v[6], sizeof v[6], s->nallreduce);
    meta_i64(v[7], sizeof v[7], (int64_t)s->nmem);
    meta_i64(v[8], sizeof v[8], s->o.matrix_approximation_rank);
    meta_i64(v[9], sizeof v[9], s->o.start_powerSGD_iter);
    snprintf(v[10], sizeof v[10], "%s", s->o.use_error_feedback ? "true" : "false");
    snprintf(v[11], sizeof v[11], "%s", s->o.warm_start ? "true" : "false");
    snprintf(v[12], sizeof v[12], "%" PRIu64, s->o.random_seed);
    const char *vals[PSGD_NMETA];
    for (int i = 0; i < PSGD_NMETA; i++) vals[i] = v[i];
    st = ddp_st_write(path, e, n, keys, vals, PSGD_NMETA, err);
  }
out:
  ddp__free(e);
  ddp__free(t);
  ddp__free(names);
  return st;
}

/* A metadata integer; false when absent or malformed. */
static bool meta_get_i64(const ddp_st_file_t *f, const char *key, int64_t *out) {
  const char *v = ddp_st_meta_get(f, key);
  if (!v || !v[0]) return false;
  char *end;
  long long x = strtoll(v, &end, 10);
  if (*end) return false;
  *out = (int64_t)x;
  return true;
}

/* Copies the f32 vector `name` (absent: *data NULL) into a fresh allocation. */
static ddp_status_t load_vec(const ddp_st_file_t *f, const char *name, float **data, size_t *len,
                             bool *present) {
  size_t i;
  *data = NULL;
  *len = 0;
  *present = false;
  if (ddp_st_find(f, name, &i) != DDP_OK) return DDP_OK;
  ddp_tensor_t v;
  DDP_CHECK(ddp_st_tensor(f, i, &v));
  if (v.dtype != DDP_F32 || v.ndim != 1) return DDP_ERR_INVALID_DATA;
  *data = ddp__malloc(((size_t)v.numel + 1) * sizeof(float));
  if (!*data) return DDP_ERR_NO_MEMORY;
  if (v.numel) memcpy(*data, v.data, (size_t)v.numel * sizeof(float));
  *len = (size_t)v.numel;
  *present = true;
  return DDP_OK;
}

ddp_status_t ddp_powersgd_state_load(ddp_powersgd_state_t *s, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && path);
  ddp_st_file_t *f = NULL;
  DDP_CHECK(ddp_st_open(path, DDP_ST_READ, &f, err));
  ddp_status_t st = DDP_OK;
  psgd_mem_t *mem = NULL;
  size_t nmem = 0;
  const char *fmt = ddp_st_meta_get(f, "format");
  int64_t iter, draws, before, after, next, nall, nb, rank, start, seed;
  if (!fmt || strcmp(fmt, PSGD_FORMAT) != 0 || !meta_get_i64(f, "iter", &iter) ||
      !meta_get_i64(f, "draws", &draws) ||
      !meta_get_i64(f, "total_numel_before_compression", &before) ||
      !meta_get_i64(f, "total_numel_after_compression", &after) ||
      !meta_get_i64(f, "next_stats_report", &next) || !meta_get_i64(f, "num_allreduces", &nall) ||
      !meta_get_i64(f, "buckets", &nb) || nb < 0 || nb > (1 << 24) ||
      !meta_get_i64(f, "matrix_approximation_rank", &rank) ||
      !meta_get_i64(f, "start_powerSGD_iter", &start) || !meta_get_i64(f, "random_seed", &seed)) {
    st = ddp__error(err, s->rank, DDP_ERR_INVALID_DATA,
                    "PowerSGD state %s: not a %s file (missing or malformed metadata)", path,
                    PSGD_FORMAT);
    goto out;
  }
  const char *ef = ddp_st_meta_get(f, "use_error_feedback");
  const char *ws = ddp_st_meta_get(f, "warm_start");
  bool saved_ef = ef && !strcmp(ef, "true"), saved_ws = ws && !strcmp(ws, "true");
  /* Options that shape the stored tensors must match; the others only steer later calls. */
  if (rank != s->o.matrix_approximation_rank || start != s->o.start_powerSGD_iter ||
      (uint64_t)seed != s->o.random_seed || saved_ef != s->o.use_error_feedback ||
      saved_ws != s->o.warm_start) {
    st = ddp__error(err, s->rank, DDP_ERR_INVALID_ARGUMENT,
                    "PowerSGD state %s was saved with matrix_approximation_rank %" PRId64
                    ", start_powerSGD_iter %" PRId64 ", random_seed %" PRId64
                    ", use_error_feedback %d, warm_start %d; this state has %" PRId64 ", %" PRId64
                    ", %" PRIu64 ", %d, %d",
                    path, rank, start, seed, saved_ef, saved_ws, s->o.matrix_approximation_rank,
                    s->o.start_powerSGD_iter, s->o.random_seed, s->o.use_error_feedback,
                    s->o.warm_start);
    goto out;
  }
  nmem = (size_t)nb;
  mem = ddp__calloc(nmem + 1, sizeof *mem);
  if (!mem) {
    st = ddp__error(err, s->rank, DDP_ERR_NO_MEMORY, "PowerSGD state load: out of memory");
    goto out;
  }
  for (size_t b = 0; b < nmem && st == DDP_OK; b++) {
    char name[48];
    bool has_e = false, has_p = false, has_q = false;
    snprintf(name, sizeof name, "bucket.%zu.error", b);
    st = load_vec(f, name, &mem[b].error, &mem[b].nerror, &has_e);
    snprintf(name, sizeof name, "bucket.%zu.p", b);
    if (st == DDP_OK) st = load_vec(f, name, &mem[b].p, &mem[b].np, &has_p);
    snprintf(name, sizeof name, "bucket.%zu.q", b);
    if (st == DDP_OK) st = load_vec(f, name, &mem[b].q, &mem[b].nq, &has_q);
    if (st == DDP_OK && has_p != has_q) st = DDP_ERR_INVALID_DATA;
    snprintf(name, sizeof name, "bucket.%zu.layout", b);
    size_t li;
    if (st == DDP_OK && ddp_st_find(f, name, &li) == DDP_OK) {
      ddp_tensor_t v;
      st = ddp_st_tensor(f, li, &v);
      if (st == DDP_OK && (v.dtype != DDP_I64 || v.ndim != 2 || v.shape[1] != 4))
        st = DDP_ERR_INVALID_DATA;
      if (st == DDP_OK) {
        mem[b].lay = ddp__malloc(((size_t)v.numel + 1) * sizeof(size_t));
        if (!mem[b].lay) st = DDP_ERR_NO_MEMORY;
      }
      if (st == DDP_OK) {
        memcpy(mem[b].lay, v.data, (size_t)v.numel * sizeof(size_t));
        mem[b].nlay = (size_t)v.shape[0];
      }
    }
    mem[b].has_mem = has_p && has_q;
    if (st != DDP_OK) {
      st = ddp__error(err, s->rank, st,
                      "PowerSGD state %s: bucket %zu: tensors must be f32 vectors, with p and "
                      "q present together, and the layout i64 [n, 4]",
                      path, b);
    }
  }
  if (st != DDP_OK) goto out;
  /* Replace the state only once the whole file has been read. */
  for (size_t i = 0; i < s->nmem; i++) ddp__psgd_mem_free(&s->mem[i]);
  ddp__free(s->mem);
  s->mem = mem;
  s->nmem = nmem;
  mem = NULL;
  s->iter = iter;
  s->draws = (uint64_t)draws;
  s->total_before = before;
  s->total_after = after;
  s->next_stats_report = next;
  s->nallreduce = nall;
  s->bytes_step = 0;
out:
  for (size_t i = 0; mem && i < nmem; i++) ddp__psgd_mem_free(&mem[i]);
  ddp__free(mem);
  ddp_st_close(f);
  return st;
}
