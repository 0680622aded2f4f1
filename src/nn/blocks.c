/* Blocks: the units a model's forward runs one after the other (a transformer layer of a
 * Transformers family, a child of a Sequential root), and the hooks around each that
 * sharded training uses to gather and free a block's parameters (include/ddp/nn.h,
 * "Blocks"). Hooks fire in forward before and after the block and, through identity nodes
 * recorded at its output and input, in backward before and after it. Above autograd (it
 * records nodes) and below the model's forward, which calls in here: nothing here calls
 * the model's functions, it reads the model's fields. */
#include <string.h>

#include "nn/nn_internal.h"

static const char *kind_class(mod_kind_t k) {
  return (const char *const[]){"Linear",     "LayerNorm", "BatchNorm1d", "Embedding", "Dropout",
                               "Activation", "Flatten",   "Sequential",  "Residual",  "Branch",
                               "Checkpoint", "Add",       "FamilyModel"}[k];
}
/* Parameters of mod's subtree: their count, smallest and largest index. */
static void subtree_params(const ddp_module_t *mod, size_t *n, size_t *lo, size_t *hi) {
  for (int j = 0; j < 2; j++)
    if (mod->p[j] != NONE) {
      (*n)++;
      if (mod->p[j] < *lo) *lo = mod->p[j];
      if (mod->p[j] > *hi) *hi = mod->p[j];
    }
  if (mod->body) subtree_params(mod->body, n, lo, hi);
  for (size_t i = 0; i < mod->nchildren; i++) subtree_params(mod->children[i], n, lo, hi);
}

ddp_status_t ddp__model_add_block(ddp_model_t *m, const char *cls, size_t first, size_t count) {
  ddp__blocks_t *b = &m->blocks;
  if (b->n == b->cap) {
    size_t cap = b->cap ? 2 * b->cap : 16;
    ddp__block_t *nb = ddp__realloc(b->b, cap * sizeof *nb);
    if (!nb) return DDP_ERR_NO_MEMORY;
    b->b = nb;
    b->cap = cap;
  }
  b->b[b->n++] = (ddp__block_t){cls, first, count, NONE};
  return DDP_OK;
}

ddp__blocks_t *ddp__model_blocks(ddp_model_t *m) {
  ddp__blocks_t *b = &m->blocks;
  if (!b->scanned && b->n == 0 && m->root && m->root->kind == MOD_SEQ) {
    /* A Sequential root: each child whose parameters are contiguous is a block. */
    for (size_t i = 0; i < m->root->nchildren; i++) {
      const ddp_module_t *ch = m->root->children[i];
      size_t n = 0, lo = NONE, hi = 0;
      subtree_params(ch, &n, &lo, &hi);
      if (n == 0 || hi - lo + 1 != n) continue;
      if (ddp__model_add_block(m, kind_class(ch->kind), lo, n) != DDP_OK) break;
      b->b[b->n - 1].child = i;
    }
  }
  b->scanned = true;
  return b;
}

size_t ddp__block_of_child(ddp_model_t *m, size_t child) {
  ddp__blocks_t *b = ddp__model_blocks(m);
  if (!b->hooked) return (size_t)-1;
  for (size_t k = 0; k < b->n; k++)
    if (b->b[k].child == child) return k;
  return (size_t)-1;
}

size_t ddp_model_num_blocks(ddp_model_t *m) {
  DDP_REQUIRE(m);
  return ddp__model_blocks(m)->n;
}

void ddp_model_block(ddp_model_t *m, size_t k, const char **cls, size_t *first, size_t *count) {
  DDP_REQUIRE(m && k < ddp__model_blocks(m)->n);
  const ddp__block_t *b = &ddp__model_blocks(m)->b[k];
  if (cls) *cls = b->cls;
  if (first) *first = b->first;
  if (count) *count = b->count;
}

void ddp_model_set_block_hooks(ddp_model_t *m, const ddp_block_hooks_t *hooks) {
  DDP_REQUIRE(m);
  ddp__blocks_t *b = ddp__model_blocks(m);
  b->hooked = hooks != NULL;
  if (hooks) b->hooks = *hooks;
}

/* The identity nodes around a block (nn_internal.h): i0 = the block, saved = the model. */
static ddp_status_t pass_grad(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *in = n->ins[0];
  if (!in->requires_grad) return DDP_OK;
  void *g = ddp__grad(c, in);
  if (!g) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "block hook: arena exhausted");
  ddp__accumulate(in->value.dtype, g, n->out->grad.data, in->value.numel);
  return DDP_OK;
}

static ddp_status_t hook_status(ddp_ctx_t *c, ddp_status_t st, const char *what, size_t k) {
  if (st == DDP_OK) return DDP_OK;
  return ddp__ctx_error(c, st, "block %zu: the %s hook failed (%s)", k, what, ddp_status_name(st));
}

static ddp_status_t bw_block_input(ddp_ctx_t *c, ddp_node_t *n) {
  DDP_CHECK(pass_grad(c, n));
  ddp__blocks_t *b = ddp__model_blocks(n->saved);
  if (!b->hooked || !b->hooks.post_backward) return DDP_OK;
  return hook_status(c, b->hooks.post_backward(b->hooks.user, (size_t)n->i0), "post-backward",
                     (size_t)n->i0);
}

static ddp_status_t bw_block_output(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_model_t *m = n->saved;
  ddp__blocks_t *b = ddp__model_blocks(m);
  if (b->hooked && b->hooks.pre_backward) {
    DDP_CHECK(hook_status(c, b->hooks.pre_backward(b->hooks.user, (size_t)n->i0), "pre-backward",
                          (size_t)n->i0));
    /* The hook may have moved the parameters: the leaves of this step follow them. */
    for (size_t i = 0; i < m->nparams; i++) {
      ddp_param_t *p = &m->params[i];
      if (p->leaf_ && p->leaf_gen_ == c->gen) p->leaf_->value.data = p->value.data;
    }
  }
  return pass_grad(c, n);
}

static ddp_status_t block_marker(ddp_ctx_t *c, ddp_model_t *m, size_t k, ddp__backward_fn bw,
                                 ddp_var_t **h) {
  ddp_var_t *x = *h;
  if (!ddp__needs_grad(c, 1, &x)) return DDP_OK;
  ddp_var_t *y = ddp__arena_zalloc(c, sizeof *y);
  ddp_node_t *n = y ? ddp__node_new(c, "block_hook", bw, y, 1, &x) : NULL;
  if (!n) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "block hook: arena exhausted");
  y->value = x->value;
  y->value.owns = false;
  n->saved = m;
  n->i0 = (int64_t)k;
  *h = y;
  return DDP_OK;
}

ddp_status_t ddp__block_enter(ddp_ctx_t *c, ddp_model_t *m, size_t k, ddp_var_t **h) {
  ddp__blocks_t *b = ddp__model_blocks(m);
  if (!b->hooked) return DDP_OK;
  if (b->hooks.pre_forward)
    DDP_CHECK(hook_status(c, b->hooks.pre_forward(b->hooks.user, k), "pre-forward", k));
  return block_marker(c, m, k, bw_block_input, h);
}

ddp_status_t ddp__block_leave(ddp_ctx_t *c, ddp_model_t *m, size_t k, ddp_var_t **h) {
  ddp__blocks_t *b = ddp__model_blocks(m);
  if (!b->hooked) return DDP_OK;
  if (b->hooks.post_forward)
    DDP_CHECK(hook_status(c, b->hooks.post_forward(b->hooks.user, k), "post-forward", k));
  return block_marker(c, m, k, bw_block_output, h);
}
