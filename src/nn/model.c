/* Models: named parameters and buffers in flat per-dtype buffers, modules and their
 * forward, PyTorch's default initialisation, and state_dict save/load through safetensors. */
#include <math.h>
#include <string.h>

#include "nn/nn_internal.h"

/* ---------------------------------------------------------------- registry -------- */

ddp_status_t ddp_model_create(ddp_model_t **out) {
  DDP_REQUIRE(out);
  *out = ddp__calloc(1, sizeof **out);
  if (!*out) return DDP_ERR_NO_MEMORY;
  (*out)->training = true;
  return DDP_OK;
}

void ddp_model_destroy(ddp_model_t *m) {
  if (!m) return;
  for (size_t i = 0; i < m->nparams; i++) ddp__free((void *)m->params[i].name);
  for (size_t i = 0; i < m->nbuffers; i++) {
    ddp__free((void *)m->buffers[i].name);
    ddp_tensor_free(&m->buffers[i].value);
  }
  for (int d = 0; d < DDP_DTYPE_COUNT_; d++) {
    ddp__aligned_free(m->flat[d]);
    ddp__aligned_free(m->gflat[d]);
  }
  for (ddp_module_t *mod = m->mod_head; mod;) {
    ddp_module_t *next = mod->next_owned;
    if (mod->family && mod->family->destroy) mod->family->destroy(mod->fstate);
    ddp__free(mod->children);
    ddp__free(mod);
    mod = next;
  }
  ddp__free(m->blocks.b);
  ddp__free(m->params);
  ddp__free(m->buffers);
  ddp__free(m->entries);
  ddp__free(m);
}

static bool grow(void **arr, size_t *cap, size_t n, size_t elem) {
  if (n < *cap) return true;
  size_t nc = *cap ? *cap * 2 : 16;
  void *p = ddp__realloc(*arr, nc * elem);
  if (!p) return false;
  *arr = p;
  *cap = nc;
  return true;
}

static bool name_taken(const ddp_model_t *m, const char *name) {
  for (size_t i = 0; i < m->nparams; i++)
    if (!strcmp(m->params[i].name, name)) return true;
  for (size_t i = 0; i < m->nbuffers; i++)
    if (!strcmp(m->buffers[i].name, name)) return true;
  return false;
}

static ddp_status_t check_new_name(const ddp_model_t *m, const char *name, ddp_dtype_t dt, int ndim,
                                   const int64_t *shape, int64_t *numel) {
  if (m->finalized)
    return ddp__error(NULL, -1, DDP_ERR_INVALID_USAGE,
                      "model: cannot register '%s' after ddp_model_finalize", name);
  if (!name || !*name || name_taken(m, name))
    return ddp__error(NULL, -1, DDP_ERR_INVALID_ARGUMENT,
                      "model: attribute name '%s' is empty or already exists", name ? name : "");
  if (!ddp_dtype_valid((int)dt))
    return ddp__error(NULL, -1, DDP_ERR_INVALID_ARGUMENT, "model: '%s' has an invalid dtype", name);
  return ddp_shape_numel(ndim, shape, ddp_dtype_size(dt), numel);
}

static ddp_status_t add_entry(ddp_model_t *m, bool is_param, size_t index) {
  if (!grow((void **)&m->entries, &m->cap_entries, m->nentries, sizeof *m->entries))
    return DDP_ERR_NO_MEMORY;
  m->entries[m->nentries++] = (entry_t){is_param, index};
  return DDP_OK;
}

ddp_status_t ddp_model_add_param(ddp_model_t *m, const char *name, ddp_dtype_t dt, int ndim,
                                 const int64_t *shape, bool requires_grad, size_t *index) {
  DDP_REQUIRE(m);
  int64_t numel;
  DDP_CHECK(check_new_name(m, name, dt, ndim, shape, &numel));
  if (dt != DDP_F32 && dt != DDP_F64)
    return ddp__error(NULL, -1, DDP_ERR_UNSUPPORTED,
                      "model: parameter '%s' must be F32 or F64 (got %s)", name,
                      ddp_dtype_name(dt));
  if (!grow((void **)&m->params, &m->cap_params, m->nparams, sizeof *m->params))
    return DDP_ERR_NO_MEMORY;
  ddp_param_t *p = &m->params[m->nparams];
  memset(p, 0, sizeof *p);
  p->name = ddp__strdup(name);
  if (!p->name) return DDP_ERR_NO_MEMORY;
  p->index = m->nparams;
  p->requires_grad = requires_grad;
  ddp_tensor_view(&p->value, dt, ndim, shape, NULL);
  p->offset = m->flat_numel[dt];
  m->flat_numel[dt] += numel;
  if (index) *index = m->nparams;
  m->nparams++; /* counted before add_entry, so that destroy frees the name either way */
  return add_entry(m, true, m->nparams - 1);
}

ddp_status_t ddp_model_add_buffer(ddp_model_t *m, const char *name, ddp_dtype_t dt, int ndim,
                                  const int64_t *shape, size_t *index) {
  DDP_REQUIRE(m);
  int64_t numel;
  DDP_CHECK(check_new_name(m, name, dt, ndim, shape, &numel));
  if (!grow((void **)&m->buffers, &m->cap_buffers, m->nbuffers, sizeof *m->buffers))
    return DDP_ERR_NO_MEMORY;
  ddp_buffer_t *b = &m->buffers[m->nbuffers];
  memset(b, 0, sizeof *b);
  b->name = ddp__strdup(name);
  if (!b->name) return DDP_ERR_NO_MEMORY;
  b->index = m->nbuffers;
  ddp_status_t st = ddp_tensor_alloc(&b->value, dt, ndim, shape);
  if (st != DDP_OK) {
    ddp__free((void *)b->name);
    return st;
  }
  if (index) *index = m->nbuffers;
  m->nbuffers++;
  return add_entry(m, false, m->nbuffers - 1);
}

ddp_status_t ddp_model_finalize(ddp_model_t *m) {
  DDP_REQUIRE(m && !m->finalized);
  for (int d = 0; d < DDP_DTYPE_COUNT_; d++) {
    if (!m->flat_numel[d]) continue;
    size_t bytes = (size_t)m->flat_numel[d] * ddp_dtype_size((ddp_dtype_t)d);
    m->flat[d] = ddp__aligned_alloc(bytes);
    m->gflat[d] = ddp__aligned_alloc(bytes);
    if (!m->flat[d] || !m->gflat[d]) return DDP_ERR_NO_MEMORY;
    memset(m->flat[d], 0, bytes);
    memset(m->gflat[d], 0, bytes);
  }
  for (size_t i = 0; i < m->nparams; i++) {
    ddp_param_t *p = &m->params[i];
    size_t es = ddp_dtype_size(p->value.dtype);
    p->value.data = (char *)m->flat[p->value.dtype] + (size_t)p->offset * es;
    p->grad = p->value;
    p->grad.data = (char *)m->gflat[p->value.dtype] + (size_t)p->offset * es;
    p->grad_home_ = p->grad.data;
  }
  m->finalized = true;
  return DDP_OK;
}

bool ddp_model_finalized(const ddp_model_t *m) { return m->finalized; }
size_t ddp_model_num_params(const ddp_model_t *m) { return m->nparams; }
size_t ddp_model_num_buffers(const ddp_model_t *m) { return m->nbuffers; }

ddp_param_t *ddp_model_param(ddp_model_t *m, size_t i) {
  DDP_REQUIRE(m && i < m->nparams);
  return &m->params[i];
}

ddp_buffer_t *ddp_model_buffer(ddp_model_t *m, size_t i) {
  DDP_REQUIRE(m && i < m->nbuffers);
  return &m->buffers[i];
}

ddp_param_t *ddp_model_find_param(ddp_model_t *m, const char *name) {
  DDP_REQUIRE(m && name);
  for (size_t i = 0; i < m->nparams; i++)
    if (!strcmp(m->params[i].name, name)) return &m->params[i];
  return NULL;
}

ddp_buffer_t *ddp_model_find_buffer(ddp_model_t *m, const char *name) {
  DDP_REQUIRE(m && name);
  for (size_t i = 0; i < m->nbuffers; i++)
    if (!strcmp(m->buffers[i].name, name)) return &m->buffers[i];
  return NULL;
}

static ddp_tensor_t flat_view(ddp_model_t *m, ddp_dtype_t dt, void *const *arr) {
  ddp_tensor_t t;
  memset(&t, 0, sizeof t);
  t.dtype = dt;
  if (ddp_dtype_valid((int)dt) && m->finalized && m->flat_numel[dt] && arr[dt]) {
    int64_t n = m->flat_numel[dt];
    ddp_tensor_view(&t, dt, 1, &n, arr[dt]);
  }
  return t;
}

ddp_tensor_t ddp_model_flat_params(ddp_model_t *m, ddp_dtype_t dt) {
  DDP_REQUIRE(m);
  return flat_view(m, dt, m->flat);
}

ddp_tensor_t ddp_model_flat_grads(ddp_model_t *m, ddp_dtype_t dt) {
  DDP_REQUIRE(m);
  return flat_view(m, dt, m->gflat);
}

void ddp_model_set_hook(ddp_model_t *m, ddp_grad_ready_fn fn, void *user) {
  DDP_REQUIRE(m);
  for (size_t i = 0; i < m->nparams; i++) ddp_param_set_hook(&m->params[i], fn, user);
}

void ddp_model_zero_grad(ddp_model_t *m) {
  DDP_REQUIRE(m && m->finalized);
  for (size_t i = 0; i < m->nparams; i++)
    if (m->params[i].grad.data)
      memset(m->params[i].grad.data, 0, ddp_tensor_nbytes(&m->params[i].value));
}

void ddp_model_set_grads_none(ddp_model_t *m) {
  DDP_REQUIRE(m && m->finalized);
  for (size_t i = 0; i < m->nparams; i++) m->params[i].grad.data = NULL;
}

/* ---------------------------------------------------------------- modules --------- */

static ddp_status_t mod_new(ddp_model_t *m, mod_kind_t kind, ddp_module_t **out) {
  ddp_module_t *mod = ddp__calloc(1, sizeof *mod);
  if (!mod) return DDP_ERR_NO_MEMORY;
  mod->kind = kind;
  mod->model = m;
  mod->p[0] = mod->p[1] = NONE;
  mod->buf[0] = mod->buf[1] = mod->buf[2] = NONE;
  if (m->mod_tail)
    m->mod_tail->next_owned = mod;
  else
    m->mod_head = mod;
  m->mod_tail = mod;
  *out = mod;
  return DDP_OK;
}

/* prefix + "." + leaf, or just leaf for the root prefix "". */
static const char *join(char *buf, size_t len, const char *prefix, const char *leaf) {
  if (!prefix || !*prefix)
    snprintf(buf, len, "%s", leaf);
  else
    snprintf(buf, len, "%s.%s", prefix, leaf);
  return buf;
}

#define NAME_MAX_ 512

ddp_status_t ddp_module_linear(ddp_model_t *m, const char *prefix, int64_t in, int64_t out,
                               bool bias, ddp_dtype_t dt, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  char nb[NAME_MAX_];
  int64_t ws[2] = {out, in};
  DDP_CHECK(mod_new(m, MOD_LINEAR, mod));
  (*mod)->in = in;
  (*mod)->out = out;
  DDP_CHECK(ddp_model_add_param(m, join(nb, sizeof nb, prefix, "weight"), dt, 2, ws, true,
                                &(*mod)->p[0]));
  if (bias)
    DDP_CHECK(ddp_model_add_param(m, join(nb, sizeof nb, prefix, "bias"), dt, 1, &out, true,
                                  &(*mod)->p[1]));
  return DDP_OK;
}

ddp_status_t ddp_module_layer_norm(ddp_model_t *m, const char *prefix, int64_t dim, double eps,
                                   ddp_dtype_t dt, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  char nb[NAME_MAX_];
  DDP_CHECK(mod_new(m, MOD_LAYER_NORM, mod));
  (*mod)->in = (*mod)->out = dim;
  (*mod)->eps = eps;
  DDP_CHECK(ddp_model_add_param(m, join(nb, sizeof nb, prefix, "weight"), dt, 1, &dim, true,
                                &(*mod)->p[0]));
  DDP_CHECK(ddp_model_add_param(m, join(nb, sizeof nb, prefix, "bias"), dt, 1, &dim, true,
                                &(*mod)->p[1]));
  return DDP_OK;
}

ddp_status_t ddp_module_batch_norm(ddp_model_t *m, const char *prefix, int64_t dim, double eps,
                                   double momentum, ddp_dtype_t dt, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  char nb[NAME_MAX_];
  DDP_CHECK(mod_new(m, MOD_BATCH_NORM, mod));
  (*mod)->in = (*mod)->out = dim;
  (*mod)->eps = eps;
  (*mod)->momentum = momentum;
  DDP_CHECK(ddp_model_add_param(m, join(nb, sizeof nb, prefix, "weight"), dt, 1, &dim, true,
                                &(*mod)->p[0]));
  DDP_CHECK(ddp_model_add_param(m, join(nb, sizeof nb, prefix, "bias"), dt, 1, &dim, true,
                                &(*mod)->p[1]));
  DDP_CHECK(ddp_model_add_buffer(m, join(nb, sizeof nb, prefix, "running_mean"), dt, 1, &dim,
                                 &(*mod)->buf[0]));
  DDP_CHECK(ddp_model_add_buffer(m, join(nb, sizeof nb, prefix, "running_var"), dt, 1, &dim,
                                 &(*mod)->buf[1]));
  DDP_CHECK(ddp_model_add_buffer(m, join(nb, sizeof nb, prefix, "num_batches_tracked"), DDP_I64, 0,
                                 NULL, &(*mod)->buf[2]));
  return DDP_OK;
}

ddp_status_t ddp_module_embedding(ddp_model_t *m, const char *prefix, int64_t num, int64_t dim,
                                  ddp_dtype_t dt, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  char nb[NAME_MAX_];
  int64_t ws[2] = {num, dim};
  DDP_CHECK(mod_new(m, MOD_EMBEDDING, mod));
  (*mod)->in = num;
  (*mod)->out = dim;
  DDP_CHECK(ddp_model_add_param(m, join(nb, sizeof nb, prefix, "weight"), dt, 2, ws, true,
                                &(*mod)->p[0]));
  return DDP_OK;
}

ddp_status_t ddp_module_dropout(ddp_model_t *m, double p, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  if (!(p >= 0 && p <= 1))
    return ddp__error(NULL, -1, DDP_ERR_INVALID_ARGUMENT,
                      "dropout probability has to be between 0 and 1, but got %g", p);
  DDP_CHECK(mod_new(m, MOD_DROPOUT, mod));
  (*mod)->prob = p;
  return DDP_OK;
}

ddp_status_t ddp_module_activation(ddp_model_t *m, ddp_act_t act, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod && act >= DDP_ACT_RELU && act <= DDP_ACT_SILU);
  DDP_CHECK(mod_new(m, MOD_ACT, mod));
  (*mod)->act = act;
  return DDP_OK;
}

ddp_status_t ddp_module_flatten(ddp_model_t *m, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  return mod_new(m, MOD_FLATTEN, mod);
}

ddp_status_t ddp_module_sequential(ddp_model_t *m, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  return mod_new(m, MOD_SEQ, mod);
}

ddp_status_t ddp_module_append(ddp_module_t *seq, ddp_module_t *child) {
  DDP_REQUIRE(seq && child && seq->kind == MOD_SEQ && child->model == seq->model);
  if (!grow((void **)&seq->children, &seq->cap, seq->nchildren, sizeof *seq->children))
    return DDP_ERR_NO_MEMORY;
  seq->children[seq->nchildren++] = child;
  return DDP_OK;
}

static ddp_status_t wrap(ddp_model_t *m, mod_kind_t kind, ddp_module_t *body, ddp_module_t **mod) {
  DDP_REQUIRE(m && body && mod && body->model == m);
  DDP_CHECK(mod_new(m, kind, mod));
  (*mod)->body = body;
  return DDP_OK;
}

ddp_status_t ddp_module_residual(ddp_model_t *m, ddp_module_t *body, ddp_module_t **mod) {
  return wrap(m, MOD_RESIDUAL, body, mod);
}

ddp_status_t ddp_module_branch(ddp_model_t *m, ddp_module_t *body, unsigned flag,
                               ddp_module_t **mod) {
  DDP_REQUIRE(flag < 64);
  DDP_CHECK(wrap(m, MOD_BRANCH, body, mod));
  (*mod)->flag = flag;
  return DDP_OK;
}

ddp_status_t ddp_module_checkpointed(ddp_model_t *m, ddp_module_t *body, ddp_module_t **mod) {
  return wrap(m, MOD_CHECKPOINT, body, mod);
}

ddp_status_t ddp_module_add(ddp_model_t *m, ddp_module_t **mod) {
  DDP_REQUIRE(m && mod);
  return mod_new(m, MOD_ADD, mod);
}

ddp_status_t ddp_module_add_branch(ddp_module_t *add, ddp_module_t *body, int flag) {
  DDP_REQUIRE(add && body && add->kind == MOD_ADD && body->model == add->model);
  DDP_REQUIRE(flag >= -1 && flag < 64);
  if (add->nchildren >= DDP_ADD_MAX_BRANCHES) return DDP_ERR_INVALID_ARGUMENT;
  if (!grow((void **)&add->children, &add->cap, add->nchildren, sizeof *add->children))
    return DDP_ERR_NO_MEMORY;
  add->add_flag[add->nchildren] = (int8_t)flag;
  add->children[add->nchildren++] = body;
  return DDP_OK;
}

/* MOD_ADD's forward: the active branches' outputs summed left to right. */
static ddp_status_t add_forward(ddp_module_t *mod, ddp_ctx_t *c, ddp_var_t *x, uint64_t flags,
                                ddp_var_t **y) {
  ddp_var_t *sum = NULL;
  for (size_t k = 0; k < mod->nchildren; k++) {
    int f = mod->add_flag[k];
    if (f >= 0 && !(flags & ((uint64_t)1 << f))) continue;
    ddp_var_t *h;
    DDP_CHECK(ddp_module_forward(mod->children[k], c, x, flags, &h));
    if (sum) DDP_CHECK(ddp_add(c, sum, h, &h));
    sum = h;
  }
  if (!sum)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "add: no branch is active under forward flags 0x%llx",
                          (unsigned long long)flags);
  *y = sum;
  return DDP_OK;
}

ddp_status_t ddp__module_family(ddp_model_t *m, const ddp__family_t *family, void *state,
                                ddp_module_t **mod) {
  DDP_REQUIRE(m && family && mod);
  ddp_status_t st = mod_new(m, MOD_FAMILY, mod);
  if (st != DDP_OK) {
    if (family->destroy) family->destroy(state);
    return st;
  }
  (*mod)->family = family;
  (*mod)->fstate = state;
  return DDP_OK;
}

const ddp__family_t *ddp__model_family(const ddp_model_t *m, void **state) {
  DDP_REQUIRE(m);
  if (!m->root || m->root->kind != MOD_FAMILY) return NULL;
  if (state) *state = m->root->fstate;
  return m->root->family;
}

void ddp_model_set_root(ddp_model_t *m, ddp_module_t *root) {
  DDP_REQUIRE(m && (!root || root->model == m));
  m->root = root;
}

void ddp_model_train(ddp_model_t *m, bool training) {
  DDP_REQUIRE(m);
  m->training = training;
}

/* ---------------------------------------------------------------- forward --------- */

typedef struct seg_arg {
  ddp_module_t *body;
  uint64_t flags;
} seg_arg_t;

static ddp_status_t seg_forward(void *user, ddp_ctx_t *ctx, size_t nin, ddp_var_t *const *in,
                                ddp_var_t **out) {
  seg_arg_t *a = user;
  DDP_REQUIRE(nin == 1);
  return ddp_module_forward(a->body, ctx, in[0], a->flags, out);
}

/* The module's weight and bias leaves (NULL where the module has none). */
static ddp_status_t pvars(ddp_ctx_t *c, ddp_module_t *mod, ddp_var_t **w, ddp_var_t **b) {
  ddp_var_t **out[2] = {w, b};
  for (int k = 0; k < 2; k++) {
    *out[k] = NULL;
    if (mod->p[k] == NONE) continue;
    *out[k] = ddp_param_var(c, &mod->model->params[mod->p[k]]);
    if (!*out[k]) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "forward: arena exhausted");
  }
  return DDP_OK;
}

static ddp_tensor_t *bufp(ddp_module_t *mod, int k) {
  return mod->buf[k] == NONE ? NULL : &mod->model->buffers[mod->buf[k]].value;
}

ddp_status_t ddp_module_forward(ddp_module_t *mod, ddp_ctx_t *c, ddp_var_t *x, uint64_t flags,
                                ddp_var_t **y) {
  DDP_REQUIRE(mod && c && x && y);
  DDP_REQUIRE(mod->model->finalized);
  ddp_model_t *m = mod->model;
  ddp_var_t *w, *b;
  DDP_CHECK(pvars(c, mod, &w, &b));
  switch (mod->kind) {
    case MOD_LINEAR: return ddp_linear(c, x, w, b, y);
    case MOD_LAYER_NORM: return ddp_layer_norm(c, x, w, b, mod->eps, y);
    case MOD_BATCH_NORM:
      return ddp_batch_norm(c, x, w, b, bufp(mod, 0), bufp(mod, 1), bufp(mod, 2), m->training,
                            mod->momentum, mod->eps, y);
    case MOD_EMBEDDING: return ddp_embedding(c, x, w, y);
    case MOD_DROPOUT: return ddp_dropout(c, x, mod->prob, m->training, y);
    case MOD_ACT: return ddp_activation(c, mod->act, x, y);
    case MOD_FLATTEN: {
      int64_t sh[2] = {x->value.ndim ? x->value.shape[0] : 1, -1};
      return ddp_reshape(c, x, 2, sh, y);
    }
    case MOD_SEQ: {
      ddp_var_t *h = x;
      for (size_t i = 0; i < mod->nchildren; i++) {
        size_t k = mod == m->root ? ddp__block_of_child(m, i) : NONE;
        if (k != NONE) DDP_CHECK(ddp__block_enter(c, m, k, &h));
        DDP_CHECK(ddp_module_forward(mod->children[i], c, h, flags, &h));
        if (k != NONE) DDP_CHECK(ddp__block_leave(c, m, k, &h));
      }
      *y = h;
      return DDP_OK;
    }
    case MOD_RESIDUAL: {
      ddp_var_t *h;
      DDP_CHECK(ddp_module_forward(mod->body, c, x, flags, &h));
      return ddp_add(c, x, h, y);
    }
    case MOD_BRANCH:
      if (flags & ((uint64_t)1 << mod->flag)) return ddp_module_forward(mod->body, c, x, flags, y);
      *y = x;
      return DDP_OK;
    case MOD_CHECKPOINT: {
      seg_arg_t *a = ddp__arena_alloc(c, sizeof *a);
      if (!a) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "checkpoint: arena exhausted");
      a->body = mod->body;
      a->flags = flags;
      return ddp_checkpoint(c, seg_forward, a, 1, &x, y);
    }
    case MOD_ADD: return add_forward(mod, c, x, flags, y);
    case MOD_FAMILY: return mod->family->forward(mod->fstate, c, x, m->training, y);
  }
  return DDP_ERR_INTERNAL;
}

ddp_status_t ddp_model_forward(ddp_model_t *m, ddp_ctx_t *c, ddp_var_t *x, uint64_t flags,
                               ddp_var_t **y) {
  DDP_REQUIRE(m && m->root);
  return ddp_module_forward(m->root, c, x, flags, y);
}

/* ---------------------------------------------------------------- init ------------ */

static void fill_uniform(ddp_tensor_t *t, ddp_rng_t *r, double bound) {
  for (int64_t i = 0; i < t->numel; i++) {
    double u = -bound + 2.0 * bound * ddp_rng_uniform_f64(r);
    if (t->dtype == DDP_F32)
      ((float *)t->data)[i] = (float)u;
    else
      ((double *)t->data)[i] = u;
  }
}

static void fill_const(ddp_tensor_t *t, double v) {
  for (int64_t i = 0; i < t->numel; i++) {
    if (t->dtype == DDP_F32)
      ((float *)t->data)[i] = (float)v;
    else if (t->dtype == DDP_F64)
      ((double *)t->data)[i] = v;
    else if (t->dtype == DDP_I64)
      ((int64_t *)t->data)[i] = (int64_t)v;
  }
}

ddp_status_t ddp_model_init(ddp_model_t *m, uint64_t seed) {
  DDP_REQUIRE(m && m->finalized);
  if (m->root && m->root->kind == MOD_FAMILY) return m->root->family->init(m->root->fstate, seed);
  ddp_rng_t r;
  ddp_rng_init(&r, seed, ddp_rng_stream(DDP_RNG_INIT, 0, 0));
  for (ddp_module_t *mod = m->mod_head; mod; mod = mod->next_owned) {
    ddp_tensor_t *w = mod->p[0] == NONE ? NULL : &m->params[mod->p[0]].value;
    ddp_tensor_t *b = mod->p[1] == NONE ? NULL : &m->params[mod->p[1]].value;
    switch (mod->kind) {
      case MOD_LINEAR: {
        double bound = mod->in > 0 ? 1.0 / sqrt((double)mod->in) : 0;
        fill_uniform(w, &r, bound);
        if (b) fill_uniform(b, &r, bound);
        break;
      }
      case MOD_LAYER_NORM:
      case MOD_BATCH_NORM:
        fill_const(w, 1);
        fill_const(b, 0);
        if (mod->kind == MOD_BATCH_NORM) {
          fill_const(bufp(mod, 0), 0);
          fill_const(bufp(mod, 1), 1);
          fill_const(bufp(mod, 2), 0);
        }
        break;
      case MOD_EMBEDDING:
        for (int64_t i = 0; i < w->numel; i++) {
          double v = ddp_rng_normal(&r);
          if (w->dtype == DDP_F32)
            ((float *)w->data)[i] = (float)v;
          else
            ((double *)w->data)[i] = v;
        }
        break;
      default: break;
    }
  }
  return DDP_OK;
}

/* ---------------------------------------------------------------- state dict ------ */

static const char *entry_name(const ddp_model_t *m, const entry_t *e) {
  return e->is_param ? m->params[e->index].name : m->buffers[e->index].name;
}

static ddp_tensor_t *entry_tensor(ddp_model_t *m, const entry_t *e) {
  return e->is_param ? &m->params[e->index].value : &m->buffers[e->index].value;
}

ddp_status_t ddp_model_save(ddp_model_t *m, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(m && m->finalized && path);
  ddp_st_entry_t *es = ddp__calloc(m->nentries ? m->nentries : 1, sizeof *es);
  if (!es) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "save_state_dict: out of memory");
  for (size_t i = 0; i < m->nentries; i++) {
    es[i].name = entry_name(m, &m->entries[i]);
    es[i].tensor = entry_tensor(m, &m->entries[i]);
  }
  ddp_status_t st = ddp_st_write(path, es, m->nentries, NULL, NULL, 0, err);
  ddp__free(es);
  return st;
}

/* Appends to a bounded message buffer. */
static void app(char *buf, size_t len, size_t *pos, const char *fmt, ...) DDP_PRINTF(4, 5);
static void app(char *buf, size_t len, size_t *pos, const char *fmt, ...) {
  if (*pos >= len) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(buf + *pos, len - *pos, fmt, ap);
  va_end(ap);
  if (k > 0) *pos = DDP_MIN(len, *pos + (size_t)k);
}

static void shape_str(const ddp_tensor_t *t, char *buf, size_t len) {
  size_t pos = 0;
  app(buf, len, &pos, "torch.Size([");
  for (int i = 0; i < t->ndim; i++)
    app(buf, len, &pos, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
  app(buf, len, &pos, "])");
}

static bool is_float_dt(ddp_dtype_t d) {
  return d == DDP_F32 || d == DDP_F64 || d == DDP_F16 || d == DDP_BF16;
}

/* Appends PyTorch's size-mismatch line (or libddp's dtype-mismatch line) for checkpoint key
 * `key` when src cannot be copied into dst. Returns whether it appended. */
static bool mismatch(const char *key, const ddp_tensor_t *src, const ddp_tensor_t *dst, char *size,
                     size_t len, size_t *ps) {
  bool shape_ok = src->ndim == dst->ndim;
  for (int d = 0; shape_ok && d < dst->ndim; d++) shape_ok = src->shape[d] == dst->shape[d];
  if (!shape_ok) {
    char a[128], b[128];
    shape_str(src, a, sizeof a);
    shape_str(dst, b, sizeof b);
    app(size, len, ps,
        "\n\tsize mismatch for %s: copying a param with shape %s from checkpoint, the shape "
        "in current model is %s.",
        key, a, b);
    return true;
  }
  if (is_float_dt(src->dtype) != is_float_dt(dst->dtype)) {
    app(size, len, ps, "\n\tdtype mismatch for %s: checkpoint has %s, model has %s.", key,
        ddp_dtype_name(src->dtype), ddp_dtype_name(dst->dtype));
    return true;
  }
  return false;
}

static size_t find_entry(const ddp_model_t *m, const char *name) {
  for (size_t j = 0; j < m->nentries; j++)
    if (!strcmp(entry_name(m, &m->entries[j]), name)) return j;
  return NONE;
}

ddp_status_t ddp_model_load(ddp_model_t *m, const char *path, bool strict, size_t *n_missing,
                            size_t *n_unexpected, ddp_error_t *err) {
  return ddp__model_load_mapped(m, path, strict, NULL, NULL, n_missing, n_unexpected, err);
}

ddp_status_t ddp__model_load_mapped(ddp_model_t *m, const char *path, bool strict,
                                    ddp__load_key_fn map, void *user, size_t *n_missing,
                                    size_t *n_unexpected, ddp_error_t *err) {
  DDP_REQUIRE(path);
  ddp_st_file_t *f = NULL;
  DDP_CHECK(ddp_st_open(path, DDP_ST_READ, &f, err));
  ddp_status_t st = ddp__model_load_files(m, &f, 1, path, strict, map, user, n_missing,
                                          n_unexpected, err);
  ddp_st_close(f);
  return st;
}

/* Two passes: the first checks every key and collects PyTorch's error list (missing keys,
 * unexpected keys, size mismatches); the second copies, only when the first found nothing
 * fatal, so a failed load leaves the model untouched. Keys are numbered across the files in
 * order (key i is tensor loc[i] of file fi[i]); src[j] is the key that fills entry j (NONE:
 * missing), hit[i] the entry key i maps to (NONE: skipped or unexpected). */
ddp_status_t ddp__model_load_files(ddp_model_t *m, ddp_st_file_t *const *files, size_t nfiles,
                                   const char *source, bool strict, ddp__load_key_fn map,
                                   void *user, size_t *n_missing, size_t *n_unexpected,
                                   ddp_error_t *err) {
  DDP_REQUIRE(m && m->finalized && source && (files || nfiles == 0));
  size_t nkeys = 0;
  for (size_t f = 0; f < nfiles; f++) nkeys += ddp_st_count(files[f]);
  size_t *src = ddp__malloc((m->nentries + 3 * nkeys + 1) * sizeof *src), *hit = src + m->nentries;
  if (!src) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "load_state_dict: out of memory");
  size_t *fi = hit + nkeys, *loc = fi + nkeys;
  for (size_t f = 0, i = 0; f < nfiles; f++)
    for (size_t k = 0; k < ddp_st_count(files[f]); k++, i++) {
      fi[i] = f;
      loc[i] = k;
    }
  char msg[DDP_ERROR_MSG_MAX * 4];
  char miss[DDP_ERROR_MSG_MAX], unexp[DDP_ERROR_MSG_MAX], size[DDP_ERROR_MSG_MAX * 2];
  size_t pm = 0, pu = 0, ps = 0, nmiss = 0, nunexp = 0, nsize = 0;
  miss[0] = unexp[0] = size[0] = 0;
  ddp_status_t st = DDP_OK;
  for (size_t j = 0; j < m->nentries; j++) src[j] = NONE;
  for (size_t i = 0; i < nkeys; i++) {
    const char *key = ddp_st_name(files[fi[i]], loc[i]);
    char buf[NAME_MAX_];
    const char *name = map ? map(user, key, buf, sizeof buf) : key;
    hit[i] = name ? find_entry(m, name) : NONE;
    if (name && hit[i] == NONE) {
      app(unexp, sizeof unexp, &pu, "%s\"%s\"", nunexp ? ", " : "", key);
      nunexp++;
    } else if (name && (src[hit[i]] == NONE || !strcmp(key, name))) {
      src[hit[i]] = i;
    }
  }
  for (size_t i = 0; i < m->nentries + nkeys; i++) {
    /* Entries in state_dict order, then the keys that only duplicate another. */
    bool entry = i < m->nentries;
    size_t j = entry ? i : hit[i - m->nentries], k = entry ? src[i] : i - m->nentries;
    if (entry && k == NONE) {
      app(miss, sizeof miss, &pm, "%s\"%s\"", nmiss ? ", " : "", entry_name(m, &m->entries[i]));
      nmiss++;
      continue;
    }
    if (!entry && (j == NONE || src[j] == k)) continue;
    ddp_tensor_t t;
    const char *key = ddp_st_name(files[fi[k]], loc[k]);
    st = ddp_st_tensor(files[fi[k]], loc[k], &t);
    if (st != DDP_OK) {
      st = ddp__error(err, -1, st, "load_state_dict: cannot read '%s' from %s", key, source);
      goto out;
    }
    if (mismatch(key, &t, entry_tensor(m, &m->entries[j]), size, sizeof size, &ps)) nsize++;
  }
  if (n_missing) *n_missing = nmiss;
  if (n_unexpected) *n_unexpected = nunexp;
  if (nsize > 0 || (strict && (nmiss || nunexp))) {
    size_t pos = 0;
    app(msg, sizeof msg, &pos, "Error(s) in loading state_dict from %s:", source);
    if (strict && nmiss) app(msg, sizeof msg, &pos, "\n\tMissing key(s) in state_dict: %s. ", miss);
    if (strict && nunexp)
      app(msg, sizeof msg, &pos, "\n\tUnexpected key(s) in state_dict: %s. ", unexp);
    if (nsize) app(msg, sizeof msg, &pos, "%s", size);
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA, "%s", msg);
    goto out;
  }
  for (size_t j = 0; j < m->nentries; j++) {
    if (src[j] == NONE) continue;
    ddp_tensor_t t;
    st = ddp_st_tensor(files[fi[src[j]]], loc[src[j]], &t);
    if (st == DDP_OK) st = ddp_tensor_copy(entry_tensor(m, &m->entries[j]), &t);
    if (st != DDP_OK) {
      st = ddp__error(err, -1, st, "load_state_dict: copying '%s' failed",
                      entry_name(m, &m->entries[j]));
      goto out;
    }
  }
out:
  ddp__free(src);
  return st;
}

bool ddp_model_param_in_layer_norm(const ddp_model_t *m, size_t index) {
  DDP_REQUIRE(m);
  for (const ddp_module_t *mod = m->mod_head; mod; mod = mod->next_owned)
    if (mod->kind == MOD_LAYER_NORM && (mod->p[0] == index || mod->p[1] == index)) return true;
  void *state;
  const ddp__family_t *fam = ddp__model_family(m, &state);
  return fam && fam->is_norm && fam->is_norm(state, index);
}

void ddp_model_release_storage(ddp_model_t *m) {
  DDP_REQUIRE(m && m->finalized);
  for (int d = 0; d < DDP_DTYPE_COUNT_; d++) {
    ddp__aligned_free(m->flat[d]);
    ddp__aligned_free(m->gflat[d]);
    m->flat[d] = m->gflat[d] = NULL;
  }
  for (size_t i = 0; i < m->nparams; i++) {
    ddp_param_t *p = &m->params[i];
    p->value.data = p->grad.data = p->grad_home_ = NULL;
  }
}
ddp_status_t ddp_model_restore_storage(ddp_model_t *m) {
  DDP_REQUIRE(m && m->finalized);
  for (int d = 0; d < DDP_DTYPE_COUNT_; d++)
    if (m->flat[d] || m->gflat[d]) return DDP_OK; /* never released */
  m->finalized = false;
  return ddp_model_finalize(m);
}
