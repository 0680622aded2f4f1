/* Private structures of the nn layer: the arena, the tape node and the context. */
#ifndef DDP_NN_INTERNAL_H
#define DDP_NN_INTERNAL_H

#include "common/common.h"
#include "ddp/nn.h"

/* The arena is a list of chunks used as a bump allocator. Reset rewinds it; when a step
 * needed more than one chunk, reset replaces them by one chunk of the total size, so from
 * the second step on a step of the same shape allocates nothing. */
typedef struct ddp__chunk {
  struct ddp__chunk *next;
  size_t cap, used;
  unsigned char *base;
} ddp__chunk_t;

typedef ddp_status_t (*ddp__backward_fn)(ddp_ctx_t *c, ddp_node_t *n);

#define DDP__NODE_INLINE_INS 3

struct ddp_node {
  ddp__backward_fn backward;
  const char *name; /* op name, for messages */
  ddp_node_t *prev; /* previous node on the tape */
  ddp_var_t *out;
  ddp_var_t **ins;
  size_t nin;
  ddp_var_t *ins_inline[DDP__NODE_INLINE_INS];
  void *saved; /* op-specific arena data */
  void *saved2;
  double a0, a1; /* op-specific scalars */
  int64_t i0, i1;
  uint64_t mark;     /* backward id that needs this node */
  bool fire_reverse; /* finalize parameter inputs last-to-first (see run_backward) */
  /* checkpoint */
  ddp_segment_fn seg_fn;
  void *seg_user;
  uint64_t seg_dropout_ctr;
};

struct ddp_ctx {
  ddp__chunk_t *chunks; /* head is the current chunk */
  size_t total_cap;
  size_t used_total; /* bytes handed out since reset, across chunks */
  ddp_node_t *tail;  /* last recorded node */
  bool grad_enabled;
  uint64_t gen;      /* parameter-leaf generation (bumped at reset and recompute) */
  uint64_t mark_seq; /* ids for backward passes and graph searches */
  uint64_t bwd_id;   /* id of the running outermost backward */
  int bwd_depth;
  uint64_t rng_seed;
  uint32_t rng_rank;
  uint64_t rng_step;
  uint64_t dropout_ctr; /* dropout calls so far this step */
  ddp_backward_callback_fn cb_fn[DDP_CTX_MAX_CALLBACKS];
  void *cb_user[DDP_CTX_MAX_CALLBACKS];
  int ncb;
  ddp_error_t err;
  /* The last arena request that failed: its bytes and the chunk malloc was asked for (0:
   * none since reset), for ddp__ctx_error's out-of-memory message. */
  size_t oom_request, oom_chunk;
};

void *ddp__arena_alloc(ddp_ctx_t *c, size_t bytes); /* 64-byte aligned, not zeroed */
void *ddp__arena_zalloc(ddp_ctx_t *c, size_t bytes);
/* A var with value storage in the arena (zeroed), no grad. NULL when out of memory. */
ddp_var_t *ddp__var_alloc(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape);
/* The same with the value storage left unwritten, for an op that writes every element of
 * its output (zeroing a GPT-2 step's outputs cost about 30 ms at 124M). */
ddp_var_t *ddp__var_alloc_raw(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape);
/* A node recording op `name` with output out and inputs ins (copied), appended to the tape,
 * and out->creator set. NULL when out of memory. */
ddp_node_t *ddp__node_new(ddp_ctx_t *c, const char *name, ddp__backward_fn bw, ddp_var_t *out,
                          size_t nin, ddp_var_t *const *ins);
/* Whether an op with these inputs must be recorded (grad mode on and an input requires
 * grad). */
bool ddp__needs_grad(const ddp_ctx_t *c, size_t nin, ddp_var_t *const *ins);
/* v's gradient storage, allocated zeroed on first use. NULL when out of memory. */
void *ddp__grad(ddp_ctx_t *c, ddp_var_t *v);
/* Sets the context's error. DDP_ERR_NO_MEMORY after a failed arena request appends the
 * bytes asked for and what the arena held ("... (out of memory: 4294967296 bytes asked for,
 * a new arena chunk of ...)"), so the message names what asked (the op) and how much. */
ddp_status_t ddp__ctx_error(ddp_ctx_t *c, ddp_status_t st, const char *fmt, ...) DDP_PRINTF(3, 4);

/* ---- module families implemented outside model.c (the Transformers models) ---- */

/* A family module is a model's root whose forward and initialisation live in their own
 * file (gpt2.c, bert.c). Its state begins with the model's ddp_hf_config_t. The model owns
 * the state and frees it with destroy. */
typedef struct ddp__family {
  const char *name;
  ddp_model_task_t task;
  ddp_status_t (*forward)(void *state, ddp_ctx_t *c, ddp_var_t *x, bool training, ddp_var_t **y);
  ddp_status_t (*init)(void *state, uint64_t seed);
  void (*destroy)(void *state);
  /* Optional: whether parameter index is a normalisation weight that is not a LayerNorm
   * module's (Llama's RMSNorm), for ddp_model_param_in_layer_norm. */
  bool (*is_norm)(void *state, size_t index);
} ddp__family_t;

/* A family module holding state (owned by m from this call on, also when it fails). */
ddp_status_t ddp__module_family(ddp_model_t *m, const ddp__family_t *family, void *state,
                                ddp_module_t **mod);
/* The family of m's root and its state; NULL when the root is not a family module. */
const ddp__family_t *ddp__model_family(const ddp_model_t *m, void **state);

/* Maps a checkpoint key to the model's name for it (writing into buf when it renames):
 * returns the name, or NULL to skip the key (a buffer the model does not keep). */
typedef const char *(*ddp__load_key_fn)(void *user, const char *key, char *buf, size_t len);
/* ddp_model_load with every checkpoint key passed through map first (NULL: names as they
 * are). When two keys map to one name, the key spelled like the name gives the values and
 * the other is only checked for shape (a tied weight saved under both names). */
ddp_status_t ddp__model_load_mapped(ddp_model_t *m, const char *path, bool strict,
                                    ddp__load_key_fn map, void *user, size_t *n_missing,
                                    size_t *n_unexpected, ddp_error_t *err);
/* The same over several open files taken as one state_dict (a sharded checkpoint; the
 * caller has checked that no key is in two of them); source names them in messages. */
ddp_status_t ddp__model_load_files(ddp_model_t *m, ddp_st_file_t *const *files, size_t nfiles,
                                   const char *source, bool strict, ddp__load_key_fn map,
                                   void *user, size_t *n_missing, size_t *n_unexpected,
                                   ddp_error_t *err);

/* Transformers' families (gpt2.c, bert.c, llama.c; hf_config.c, pretrained.c). */
bool ddp__hf_activation(const char *name, ddp_act_t *act);
/* A family registers itself with a descriptor beside its builder, listed in hf_families.c's
 * table; pretrained.c builds a config's model through ddp__hf_family_find. */
typedef struct ddp__hf_family {
  ddp_hf_model_type_t type; /* DDP_HF_GPT2, ... */
  ddp_status_t (*build)(ddp_model_t *m, const ddp_hf_config_t *cfg, ddp_dtype_t dt,
                        ddp_error_t *err);
} ddp__hf_family_t;
extern const ddp__hf_family_t ddp__gpt2_family, ddp__bert_family, ddp__llama_family;
/* The registered family of type; NULL when none is. */
const ddp__hf_family_t *ddp__hf_family_find(ddp_hf_model_type_t type);
ddp_status_t ddp__gpt2_build(ddp_model_t *m, const ddp_hf_config_t *cfg, ddp_dtype_t dt,
                             ddp_error_t *err);
ddp_status_t ddp__llama_build(ddp_model_t *m, const ddp_hf_config_t *cfg, ddp_dtype_t dt,
                              ddp_error_t *err);
ddp_status_t ddp__bert_build(ddp_model_t *m, const ddp_hf_config_t *cfg, ddp_dtype_t dt,
                             ddp_error_t *err);
/* ddp_model_from_json's branch for a Transformers config.json (a "model_type" key): the
 * model in the config's torch_dtype, zero weights. */
ddp_status_t ddp__model_from_hf_json(const char *json, ddp_model_t **out, ddp_error_t *err);
/* nn.Embedding with padding_idx pad (bert.c): ids I64 [B, T] (checked by the caller), w [V, D]
 * -> [B, T, D]; the backward leaves row pad's gradient alone. */
ddp_status_t ddp__embedding_padded(ddp_ctx_t *c, ddp_var_t *ids, ddp_var_t *w, int64_t pad,
                                   ddp_var_t **y);
/* What Transformers' _init_weights does to one parameter. */
typedef enum ddp__init_role {
  DDP__INIT_NORMAL = 0, /* N(0, initializer_range): Linear/Conv1D weights, embeddings */
  DDP__INIT_PROJ,       /* N(0, initializer_range / sqrt(2 n_layer)): GPT-2's c_proj weights */
  DDP__INIT_ONE,        /* LayerNorm weights */
  DDP__INIT_ZERO        /* biases */
} ddp__init_role_t;
/* Initialises m's parameters in registration order by role[i] (one byte each), drawing from
 * Philox stream (seed, DDP_RNG_INIT, 0, 0); then zeroes row pad_row of parameter pad_param
 * (BERT's padding_idx) unless pad_param is (size_t)-1. */
void ddp__hf_init(ddp_model_t *m, const unsigned char *role, double std, double proj_std,
                  size_t pad_param, int64_t pad_row, uint64_t seed);
/* The leaf var of parameter i of m in c (an error on the context when the arena is full). */
ddp_status_t ddp__pvar(ddp_ctx_t *c, ddp_model_t *m, size_t i, ddp_var_t **v);

/* ---- the model and its modules: model.c's, read by blocks.c ---- */

typedef struct ddp__block {
  const char *cls; /* static string */
  size_t first, count;
  size_t child; /* Sequential root: the child's index; families: (size_t)-1 */
} ddp__block_t;

typedef struct ddp__blocks {
  ddp__block_t *b;
  size_t n, cap;
  bool scanned; /* a Sequential root's children looked at */
  bool hooked;
  ddp_block_hooks_t hooks;
} ddp__blocks_t;

typedef enum mod_kind {
  MOD_LINEAR,
  MOD_LAYER_NORM,
  MOD_BATCH_NORM,
  MOD_EMBEDDING,
  MOD_DROPOUT,
  MOD_ACT,
  MOD_FLATTEN,
  MOD_SEQ,
  MOD_RESIDUAL,
  MOD_BRANCH,
  MOD_CHECKPOINT,
  MOD_ADD,
  MOD_FAMILY /* forward and init in a family's own file (nn_internal.h) */
} mod_kind_t;

#define NONE ((size_t)-1)

struct ddp_module {
  mod_kind_t kind;
  ddp_model_t *model;
  ddp_module_t *next_owned; /* creation order */
  size_t p[2];              /* weight, bias parameter indices, NONE when absent */
  size_t buf[3];            /* running_mean, running_var, num_batches_tracked */
  int64_t in, out;
  double eps, momentum, prob;
  ddp_act_t act;
  unsigned flag;
  ddp_module_t *body;
  ddp_module_t **children;
  size_t nchildren, cap;
  int8_t add_flag[DDP_ADD_MAX_BRANCHES]; /* MOD_ADD: child k's flag bit, -1 = always */
  const ddp__family_t *family;           /* MOD_FAMILY */
  void *fstate;
};

/* A state_dict entry in registration order. */
typedef struct entry {
  bool is_param;
  size_t index;
} entry_t;

struct ddp_model {
  ddp_param_t *params;
  size_t nparams, cap_params;
  ddp_buffer_t *buffers;
  size_t nbuffers, cap_buffers;
  entry_t *entries;
  size_t nentries, cap_entries;
  void *flat[DDP_DTYPE_COUNT_];
  void *gflat[DDP_DTYPE_COUNT_];
  int64_t flat_numel[DDP_DTYPE_COUNT_];
  bool finalized;
  bool training;
  ddp_module_t *mod_head, *mod_tail;
  ddp_module_t *root;
  ddp__blocks_t blocks; /* blocks.c */
};

/* dst += src, elementwise, in dt (F32 or F64): how autograd sums gradients (autograd.c). */
void ddp__accumulate(ddp_dtype_t dt, void *dst, const void *src, int64_t n);

/* ---- blocks (include/ddp/nn.h "Blocks"; blocks.c) ---- */

/* A family registers its layer k (in forward order) after registering its parameters. */
ddp_status_t ddp__model_add_block(ddp_model_t *m, const char *cls, size_t first, size_t count);
ddp__blocks_t *ddp__model_blocks(ddp_model_t *m);
/* The block that child i of a Sequential root is; (size_t)-1 when none or no hooks. */
size_t ddp__block_of_child(ddp_model_t *m, size_t child);
/* Around block k's forward: enter calls pre_forward and, when *h needs a
 * gradient, records an identity node whose backward calls post_backward; leave calls
 * post_forward and records an identity node whose backward calls pre_backward and re-reads
 * the parameter leaves. *h becomes the identity's output. No-ops without hooks. */
ddp_status_t ddp__block_enter(ddp_ctx_t *c, ddp_model_t *m, size_t k, ddp_var_t **h);
ddp_status_t ddp__block_leave(ddp_ctx_t *c, ddp_model_t *m, size_t k, ddp_var_t **h);

#endif /* DDP_NN_INTERNAL_H */
