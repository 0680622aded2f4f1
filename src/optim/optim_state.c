/* Optimizer state in safetensors, named like PyTorch's optimizer.state_dict():
 * "state.<i>.<key>", where i is the parameter's position and key is momentum_buffer,
 * step, exp_avg, exp_avg_sq or max_exp_avg_sq. Hyper-parameters (PyTorch's param_groups)
 * go in the __metadata__ map as decimal strings with 17 significant digits, which
 * round-trip doubles exactly. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/io.h"
#include "ddp/optim.h"
#include "optim/optim_internal.h"

static const char *const kind_names[] = {"sgd", "adam", "adamw"};

#define NAME_MAX_ 64

/* index: the file index of each parameter (NULL: its position). */
static ddp_status_t save_impl(const ddp_optim_t *opt, const char *path, const size_t *index,
                              ddp_error_t *err) {
  DDP_REQUIRE(opt && path);
  const ddp_optim_options_t *o = &opt->opts;
  size_t cap = opt->n * 4 + 1;
  ddp_st_entry_t *entries = ddp__calloc(cap, sizeof *entries);
  char(*names)[NAME_MAX_] = ddp__calloc(cap, NAME_MAX_);
  ddp_tensor_t *steps = ddp__calloc(opt->n + 1, sizeof *steps);
  float *step_vals = ddp__calloc(opt->n + 1, sizeof *step_vals);
  ddp_status_t st = DDP_OK;
  if (!entries || !names || !steps || !step_vals) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  size_t ne = 0;
  for (size_t i = 0; i < opt->n; i++) {
    const ddp_optim_pstate_t *s = &opt->state[i];
    if (!s->has_state) continue;
#define ADD_(key, tens)                                                        \
  do {                                                                         \
    snprintf(names[ne], NAME_MAX_, "state.%zu.%s", index ? index[i] : i, key); \
    entries[ne].name = names[ne];                                              \
    entries[ne].tensor = (tens);                                               \
    ne++;                                                                      \
  } while (0)
    if (o->kind == DDP_OPTIM_SGD) {
      ADD_("momentum_buffer", &s->buf);
    } else {
      step_vals[i] = (float)s->step;
      DDP_CHECK_GOTO(ddp_tensor_view(&steps[i], DDP_F32, 0, NULL, &step_vals[i]), st, out);
      ADD_("step", &steps[i]);
      ADD_("exp_avg", &s->buf);
      ADD_("exp_avg_sq", &s->sq);
      if (o->amsgrad) ADD_("max_exp_avg_sq", &s->maxsq);
    }
#undef ADD_
  }
  char vals[9][40];
  const char *keys[9] = {"format",   "optimizer", "lr",       "weight_decay", "maximize",
                         "momentum", "dampening", "nesterov", "betas"};
  const char *mv[9];
  snprintf(vals[0], sizeof vals[0], "libddp-optim-1");
  snprintf(vals[1], sizeof vals[1], "%s", kind_names[o->kind]);
  snprintf(vals[2], sizeof vals[2], "%.17g", o->lr);
  snprintf(vals[3], sizeof vals[3], "%.17g", o->weight_decay);
  snprintf(vals[4], sizeof vals[4], "%d", (int)o->maximize);
  snprintf(vals[5], sizeof vals[5], "%.17g", o->momentum);
  snprintf(vals[6], sizeof vals[6], "%.17g", o->dampening);
  snprintf(vals[7], sizeof vals[7], "%d", (int)o->nesterov);
  snprintf(vals[8], sizeof vals[8], "%.9g,%.9g", o->beta1, o->beta2);
  for (int k = 0; k < 9; k++) mv[k] = vals[k];
  st = ddp_st_write(path, entries, ne, keys, mv, 9, err);
out:
  ddp__free(entries);
  ddp__free(names);
  ddp__free(steps);
  ddp__free(step_vals);
  return st;
}

ddp_status_t ddp_optim_save(const ddp_optim_t *opt, const char *path, ddp_error_t *err) {
  return save_impl(opt, path, NULL, err);
}

ddp_status_t ddp_optim_save_indexed(const ddp_optim_t *opt, const char *path, const size_t *index,
                                    ddp_error_t *err) {
  DDP_REQUIRE(index || opt->n == 0);
  return save_impl(opt, path, index, err);
}

/* Parses "state.<i>.<key>" into i and key; false for any other shape. */
static bool parse_name(const char *name, size_t *index, const char **key) {
  if (strncmp(name, "state.", 6) != 0) return false;
  const char *p = name + 6;
  if (*p < '0' || *p > '9') return false;
  char *end;
  unsigned long long v = strtoull(p, &end, 10);
  if (*end != '.') return false;
  *index = (size_t)v;
  *key = end + 1;
  return true;
}

/* Copies the file's tensor `name` into dst, checking dtype and element count. */
static ddp_status_t load_one(const ddp_st_file_t *f, const char *path, size_t i, const char *key,
                             ddp_tensor_t *dst, ddp_error_t *err) {
  char name[NAME_MAX_];
  snprintf(name, sizeof name, "state.%zu.%s", i, key); /* i: the file's index */
  size_t idx;
  if (ddp_st_find(f, name, &idx) != DDP_OK)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "optim load %s: parameter %zu has state but no '%s'", path, i, name);
  ddp_tensor_t v;
  DDP_CHECK(ddp_st_tensor(f, idx, &v));
  if (v.dtype != dst->dtype || v.numel != dst->numel)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "optim load %s: '%s' is %s[%lld] but parameter %zu is %s[%lld]", path, name,
                      ddp_dtype_name(v.dtype), (long long)v.numel, i, ddp_dtype_name(dst->dtype),
                      (long long)dst->numel);
  memcpy(dst->data, v.data, ddp_tensor_nbytes(dst));
  return DDP_OK;
}

static ddp_status_t load_impl(ddp_optim_t *opt, const char *path, const size_t *index,
                              ddp_error_t *err) {
  DDP_REQUIRE(opt && path);
  const ddp_optim_options_t *o = &opt->opts;
  ddp_st_file_t *f = NULL;
  ddp_status_t st = DDP_OK;
  ddp_optim_pstate_t *fresh = NULL;
  DDP_CHECK(ddp_st_open(path, DDP_ST_READ, &f, err));

  const char *kind = ddp_st_meta_get(f, "optimizer");
  if (!kind || strcmp(kind, kind_names[o->kind]) != 0) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "optim load %s: file holds state of optimizer '%s', this one is '%s'", path,
                    kind ? kind : "(none)", kind_names[o->kind]);
    goto out;
  }
  const char *lr_s = ddp_st_meta_get(f, "lr");
  char *end = NULL;
  double lr = lr_s ? strtod(lr_s, &end) : 0.0;
  if (!lr_s || *end != '\0') {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA, "optim load %s: metadata 'lr' is %s", path,
                    lr_s ? lr_s : "missing");
    goto out;
  }
  /* Every name must belong to a parameter of this optimizer (indexed: be a state name;
   * the file may hold other parameters' state too). */
  for (size_t k = 0; k < ddp_st_count(f); k++) {
    size_t i;
    const char *key;
    const char *name = ddp_st_name(f, k);
    if (!parse_name(name, &i, &key) || (!index && i >= opt->n)) {
      st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "optim load %s: tensor '%s' does not name the state of one of the %zu "
                      "parameters",
                      path, name, opt->n);
      goto out;
    }
  }
  /* Build the new state aside and swap it in only when everything loaded. */
  fresh = ddp__calloc(opt->n ? opt->n : 1, sizeof *fresh);
  if (!fresh) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  ddp_optim_pstate_t *saved = opt->state;
  for (size_t i = 0; i < opt->n; i++) {
    fresh[i].dtype = saved[i].dtype;
    fresh[i].numel = saved[i].numel;
  }
  opt->state = fresh;
  for (size_t i = 0; i < opt->n; i++) {
    char name[NAME_MAX_];
    size_t idx;
    const char *probe = o->kind == DDP_OPTIM_SGD ? "momentum_buffer" : "step";
    size_t fi = index ? index[i] : i;
    snprintf(name, sizeof name, "state.%zu.%s", fi, probe);
    if (ddp_st_find(f, name, &idx) != DDP_OK) continue;
    DDP_CHECK_GOTO(ddp__optim_state_alloc(opt, i), st, restore);
    fresh[i].has_state = true;
    if (o->kind == DDP_OPTIM_SGD) {
      DDP_CHECK_GOTO(load_one(f, path, fi, "momentum_buffer", &fresh[i].buf, err), st, restore);
    } else {
      ddp_tensor_t v;
      DDP_CHECK_GOTO(ddp_st_tensor(f, idx, &v), st, restore);
      if (v.dtype != DDP_F32 || v.numel != 1) {
        st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "optim load %s: '%s' must be an F32 scalar, got %s[%lld]", path, name,
                        ddp_dtype_name(v.dtype), (long long)v.numel);
        goto restore;
      }
      float stepv;
      memcpy(&stepv, v.data, sizeof stepv);
      fresh[i].step = stepv;
      DDP_CHECK_GOTO(load_one(f, path, fi, "exp_avg", &fresh[i].buf, err), st, restore);
      DDP_CHECK_GOTO(load_one(f, path, fi, "exp_avg_sq", &fresh[i].sq, err), st, restore);
      if (o->amsgrad)
        DDP_CHECK_GOTO(load_one(f, path, fi, "max_exp_avg_sq", &fresh[i].maxsq, err), st, restore);
    }
  }
  /* Success: drop the old state. */
  for (size_t i = 0; i < opt->n; i++) ddp__optim_state_clear(&saved[i]);
  ddp__free(saved);
  fresh = NULL;
  opt->opts.lr = lr;
  goto out;
restore:
  for (size_t i = 0; i < opt->n; i++) ddp__optim_state_clear(&fresh[i]);
  opt->state = saved;
out:
  ddp__free(fresh);
  ddp_st_close(f);
  return st;
}

ddp_status_t ddp_optim_load(ddp_optim_t *opt, const char *path, ddp_error_t *err) {
  return load_impl(opt, path, NULL, err);
}

ddp_status_t ddp_optim_load_indexed(ddp_optim_t *opt, const char *path, const size_t *index,
                                    ddp_error_t *err) {
  DDP_REQUIRE(index || opt->n == 0);
  return load_impl(opt, path, index, err);
}

bool ddp_optim_param_state(const ddp_optim_t *opt, size_t i, double *step, ddp_tensor_t *t[3]) {
  DDP_REQUIRE(opt && i < opt->n && step && t);
  ddp_optim_pstate_t *s = &opt->state[i];
  *step = s->has_state ? s->step : 0.0;
  t[0] = s->has_state && s->buf.data ? &s->buf : NULL;
  t[1] = s->has_state && s->sq.data ? &s->sq : NULL;
  t[2] = s->has_state && s->maxsq.data ? &s->maxsq : NULL;
  return s->has_state;
}

ddp_status_t ddp_optim_param_state_set(ddp_optim_t *opt, size_t i, bool has_state, double step,
                                       ddp_tensor_t *t[3], ddp_error_t *err) {
  DDP_REQUIRE(opt && i < opt->n && t);
  ddp_optim_pstate_t *s = &opt->state[i];
  ddp__optim_state_clear(s);
  t[0] = t[1] = t[2] = NULL;
  if (!has_state) return DDP_OK;
  if (ddp__optim_state_alloc(opt, i) != DDP_OK)
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY,
                      "optim: out of memory for parameter %zu's state (%lld elements)", i,
                      (long long)s->numel);
  s->has_state = true;
  s->step = step;
  return ddp_optim_param_state(opt, i, &step, t) ? DDP_OK : DDP_ERR_INTERNAL;
}
