/* Accelerate's comm-hook configuration (spec §7.9): comm_hook, comm_wrapper and
 * comm_state_option mapped onto the built-in hooks, plus "allreduce" (PyTorch's
 * allreduce_hook, which Accelerate does not name; torch_reference.py takes it too), so that
 * a wrapper can go around plain allreduce. Accelerate checks nothing; here an
 * unknown name, an unknown PowerSGDState key, a value of the wrong type or range, a wrapper
 * without a hook, or state options for a hook without state are errors that list the
 * valid choices, returned to the caller without logging (an invalid configuration is the
 * caller's to report, like any other invalid argument). ddp_hooks_create is the factory:
 * it builds the hook and its state; the caller registers it (this layer sits below the
 * reducer and calls nothing of it). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "hooks_internal.h"

static const char *const HOOKS[] = {"no",   "allreduce", "fp16",
                                    "bf16", "power_sgd", "batched_power_sgd"};
#define FIRST_PSGD 4 /* HOOKS from here on take a PowerSGD state */
static const char *const WRAPPERS[] = {"no", "fp16", "bf16"};
#define HOOKS_LIST "no, fp16, bf16, power_sgd, batched_power_sgd, allreduce"
#define WRAPPERS_LIST "no, fp16, bf16"
#define KEYS_LIST                                                            \
  "matrix_approximation_rank, start_powerSGD_iter, min_compression_rate, "   \
  "use_error_feedback, warm_start, orthogonalization_epsilon, random_seed, " \
  "compression_stats_logging_frequency, batch_tensors_with_same_shape"

static int find_name(const char *s, const char *const *names, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(s, names[i]) == 0) return (int)i;
  return -1;
}

static ddp_status_t bad(ddp_error_t *err, const char *fmt, const char *a, const char *b) {
  return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, fmt, a, b);
}

static ddp_status_t get_int(const cJSON *v, const char *key, int64_t lo, int64_t *out,
                            ddp_error_t *err) {
  if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) ||
      v->valuedouble < (double)lo || v->valuedouble > 9.0e15)
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "comm_state_option: %s must be an integer >= %lld", key, (long long)lo);
  *out = (int64_t)v->valuedouble;
  return DDP_OK;
}

static ddp_status_t get_bool(const cJSON *v, const char *key, bool *out, ddp_error_t *err) {
  if (!cJSON_IsBool(v))
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "comm_state_option: %s must be true or false", key);
  *out = cJSON_IsTrue(v);
  return DDP_OK;
}

/* Parses comm_state_option into o (starting from PowerSGDState's defaults). */
static ddp_status_t parse_state(const char *json, ddp_powersgd_options_t *o, bool *nonempty,
                                ddp_error_t *err) {
  *nonempty = false;
  if (!json || !json[0]) return DDP_OK;
  cJSON *root = cJSON_ParseWithOpts(json, NULL, 1); /* nothing after the object */
  if (!cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return bad(err,
               "comm_state_option must be a JSON object of PowerSGDState keys (%s), got "
               "'%s'",
               KEYS_LIST, json);
  }
  ddp_status_t st = DDP_OK;
  for (cJSON *v = root->child; v && st == DDP_OK; v = v->next) {
    const char *k = v->string;
    int64_t i = 0;
    *nonempty = true;
    if (strcmp(k, "matrix_approximation_rank") == 0) {
      st = get_int(v, k, 1, &i, err);
      o->matrix_approximation_rank = i;
    } else if (strcmp(k, "start_powerSGD_iter") == 0) {
      st = get_int(v, k, 0, &i, err);
      o->start_powerSGD_iter = i;
    } else if (strcmp(k, "random_seed") == 0) {
      st = get_int(v, k, 0, &i, err);
      o->random_seed = (uint64_t)i;
    } else if (strcmp(k, "compression_stats_logging_frequency") == 0) {
      if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        st = ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                              "comm_state_option: %s must be an integer", k);
      else
        o->compression_stats_logging_frequency = (int64_t)v->valuedouble;
    } else if (strcmp(k, "min_compression_rate") == 0) {
      if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        st = ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                              "comm_state_option: %s must be a number", k);
      else
        o->min_compression_rate = v->valuedouble;
    } else if (strcmp(k, "orthogonalization_epsilon") == 0) {
      if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || !isfinite(v->valuedouble))
        st = ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                              "comm_state_option: %s must be a number >= 0", k);
      else
        o->orthogonalization_epsilon = v->valuedouble;
    } else if (strcmp(k, "use_error_feedback") == 0) {
      st = get_bool(v, k, &o->use_error_feedback, err);
    } else if (strcmp(k, "warm_start") == 0) {
      st = get_bool(v, k, &o->warm_start, err);
    } else if (strcmp(k, "batch_tensors_with_same_shape") == 0) {
      st = get_bool(v, k, &o->batch_tensors_with_same_shape, err);
    } else {
      st = bad(err, "comm_state_option: unknown PowerSGDState key '%s'; valid keys: %s", k,
               KEYS_LIST);
    }
  }
  cJSON_Delete(root);
  return st;
}

/* Everything ddp_hooks_validate checks, plus the parsed choices. */
static ddp_status_t check(const char *hook, const char *wrapper, const char *state, int *h, int *w,
                          ddp_powersgd_options_t *o, ddp_error_t *err) {
  if (!hook || !hook[0]) hook = "no";
  if (!wrapper || !wrapper[0]) wrapper = "no";
  *h = find_name(hook, HOOKS, sizeof HOOKS / sizeof *HOOKS);
  if (*h < 0) return bad(err, "comm_hook: unknown value '%s'; valid choices: %s", hook, HOOKS_LIST);
  *w = find_name(wrapper, WRAPPERS, sizeof WRAPPERS / sizeof *WRAPPERS);
  if (*w < 0)
    return bad(err, "comm_wrapper: unknown value '%s'; valid choices: %s", wrapper, WRAPPERS_LIST);
  if (*h == 0 && *w != 0)
    return bad(err,
               "comm_wrapper '%s' needs a comm_hook (one of %s); Accelerate ignores it "
               "silently",
               wrapper, "fp16, bf16, power_sgd, batched_power_sgd, allreduce");
  bool nonempty;
  DDP_CHECK(parse_state(state, o, &nonempty, err));
  if (nonempty && *h < FIRST_PSGD)
    return bad(err,
               "comm_state_option applies to comm_hook power_sgd or batched_power_sgd "
               "only (PowerSGDState keys), not to '%s'%s",
               hook, "");
  if (*h >= FIRST_PSGD && (o->use_error_feedback || o->warm_start) && o->start_powerSGD_iter <= 1)
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or "
                            "`warm_start` is enabled, because PowerSGD can only be applied after "
                            "the first two iterations in DDP.");
  return DDP_OK;
}

ddp_status_t ddp_hooks_validate(const char *comm_hook, const char *comm_wrapper,
                                const char *comm_state_option, ddp_error_t *err) {
  int h, w;
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  return check(comm_hook, comm_wrapper, comm_state_option, &h, &w, &o, err);
}

/* The hook's state: the chosen hook with its state, behind an optional wrapper. */
typedef struct bundle {
  ddp_hook_counters_t counters;
  ddp_compress_wrapper_t wrap;
  ddp_powersgd_state_t *psgd;
  ddp_comm_hook_fn fn;
  void *fn_state;
  char name[96]; /* ddp_comm_hook_t.name */
} bundle_t;

static ddp_status_t bundle_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                ddp_comm_work_t **out) {
  bundle_t *x = state;
  return x->fn(x->fn_state, pg, b, out);
}

static void bundle_stats(void *state, ddp_comm_hook_stats_t *out) {
  bundle_t *x = state;
  if (x->psgd)
    ddp_powersgd_stats(x->psgd, out);
  else
    ddp_hook_counters_stats(&x->counters, out);
}

static void bundle_free(void *state) {
  bundle_t *x = state;
  ddp_powersgd_state_destroy(x->psgd);
  ddp__free(x);
}

/* save_state / load_state: only set for a bundle with a PowerSGD state. */
static ddp_status_t bundle_save(void *state, const char *path, ddp_error_t *err) {
  bundle_t *x = state;
  return ddp_powersgd_state_save(x->psgd, path, err);
}

static ddp_status_t bundle_load(void *state, const char *path, ddp_error_t *err) {
  bundle_t *x = state;
  return ddp_powersgd_state_load(x->psgd, path, err);
}

ddp_status_t ddp_hooks_create(const char *comm_hook, const char *comm_wrapper,
                              const char *comm_state_option, int rank, ddp_comm_hook_t *out,
                              ddp_error_t *err) {
  DDP_REQUIRE(out);
  memset(out, 0, sizeof *out);
  int h, w;
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  DDP_CHECK(check(comm_hook, comm_wrapper, comm_state_option, &h, &w, &o, err));
  if (h == 0) return DDP_OK;
  static const char *const hook_names[] = {"",
                                           "allreduce_hook",
                                           "fp16_compress_hook",
                                           "bf16_compress_hook",
                                           "powerSGD_hook",
                                           "batched_powerSGD_hook"};
  static const ddp_comm_hook_fn fns[] = {NULL,
                                         ddp_allreduce_hook,
                                         ddp_fp16_compress_hook,
                                         ddp_bf16_compress_hook,
                                         ddp_powersgd_hook,
                                         ddp_batched_powersgd_hook};
  bundle_t *x = ddp__calloc(1, sizeof *x);
  if (!x) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "comm hook: out of memory");
  if (h >= FIRST_PSGD) {
    ddp_status_t st = ddp_powersgd_state_create(&o, rank, &x->psgd, err);
    if (st != DDP_OK) {
      ddp__free(x);
      return st;
    }
    x->fn_state = x->psgd;
  } else {
    x->fn_state = &x->counters;
  }
  x->fn = fns[h];
  snprintf(x->name, sizeof x->name, "%s", hook_names[h]);
  if (w != 0) {
    x->wrap.dtype = w == 1 ? DDP_F16 : DDP_BF16;
    x->wrap.inner = fns[h];
    x->wrap.inner_state = x->fn_state;
    x->fn = ddp_compress_wrapper_hook;
    x->fn_state = &x->wrap;
    snprintf(x->name, sizeof x->name, "%s(%s)",
             w == 1 ? "fp16_compress_wrapper" : "bf16_compress_wrapper", hook_names[h]);
  }
  *out = (ddp_comm_hook_t){.fn = bundle_hook,
                           .state = x,
                           .name = x->name,
                           .stats = bundle_stats,
                           .free_state = bundle_free,
                           .save_state = x->psgd ? bundle_save : NULL,
                           .load_state = x->psgd ? bundle_load : NULL};
  return DDP_OK;
}

ddp_powersgd_state_t *ddp_hooks_powersgd(const ddp_comm_hook_t *hook) {
  DDP_REQUIRE(hook);
  if (hook->fn != bundle_hook || !hook->state) return NULL;
  return ((const bundle_t *)hook->state)->psgd;
}
