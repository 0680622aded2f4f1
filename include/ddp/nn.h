/* libddp nn layer: define-by-run autograd, operations, modules, models and model files.
 *
 * Three objects:
 *  - ddp_model_t owns parameters and buffers. All parameters of one dtype live in ONE flat
 *    buffer (llm.c style), gradients in one flat gradient buffer of the same layout; each
 *    ddp_param_t holds views into both. Names are PyTorch state_dict names ("0.weight",
 *    "layers.1.bias"); registration order is PyTorch's parameters() order.
 *  - ddp_ctx_t is one thread's autograd context: an arena for activations and temporaries,
 *    the tape of recorded operations, grad mode and the dropout RNG key. ddp_ctx_reset()
 *    releases everything a step created but keeps the memory, so a steady-state training step
 *    allocates nothing.
 *  - ddp_var_t is a value on the tape (an activation, an input, or a parameter's leaf). Vars
 *    live in the context's arena and are valid until the next ddp_ctx_reset().
 *
 * Backward walks the tape in reverse and accumulates into ddp_param_t.grad (+=, like
 * PyTorch's AccumulateGrad). A gradient is either defined or None, as in PyTorch: grad.data
 * NULL is None (its dtype and shape stay). Backward defines (as zeros, then accumulates) the
 * gradient of every parameter it reaches; nothing else defines one. The moment a parameter's
 * gradient for this backward is final, its gradient-ready hook fires: this is where DDP
 * hooks in. Not thread-safe per object: one context per thread. */
#ifndef DDP_NN_H
#define DDP_NN_H

#include "ddp/io.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_ctx ddp_ctx_t;
typedef struct ddp_model ddp_model_t;
typedef struct ddp_module ddp_module_t;
typedef struct ddp_node ddp_node_t;
typedef struct ddp_param ddp_param_t;

/* Called when p's gradient for the running backward is final (p->grad holds it, already
 * accumulated). fire is 1 for the first call in this outermost backward, 2 for a second
 * call (a reentrant checkpoint recomputing a segment that uses p), and so on. */
typedef void (*ddp_grad_ready_fn)(void *user, ddp_param_t *p, int fire);

struct ddp_param {
  const char *name;       /* state_dict name, owned by the model */
  size_t index;           /* registration order = PyTorch parameters() order */
  ddp_tensor_t value;     /* view into the model's flat parameter buffer for value.dtype */
  ddp_tensor_t grad;      /* view into the flat gradient buffer (see ddp_param_set_grad_data);
                           * data NULL: the gradient is None (ddp_param_set_grad_none) */
  int64_t offset;         /* element offset of value (and of grad) in its dtype's flat buffer */
  bool requires_grad;     /* false: frozen, never receives a gradient, never fires */
  ddp_grad_ready_fn hook; /* NULL: none */
  void *hook_user;
  /* Private bookkeeping of the autograd engine. */
  void *grad_home_; /* the flat gradient buffer's view, restored by set_grad_data(NULL) */
  struct ddp_var *leaf_;
  uint64_t leaf_gen_;
  uint64_t fire_bwd_;
  int fires_;
};

typedef struct ddp_var {
  ddp_tensor_t value;
  ddp_tensor_t grad; /* data NULL until a gradient flows here during backward */
  bool requires_grad;
  ddp_node_t *creator; /* the op that produced it; NULL for leaves */
  ddp_param_t *param;  /* set on a parameter's leaf */
  /* Private bookkeeping of the autograd engine. */
  int32_t pending_;
  uint64_t stamp_;
} ddp_var_t;

/* A buffer (BatchNorm running_mean/running_var/num_batches_tracked): state without grads. */
typedef struct ddp_buffer {
  const char *name;
  size_t index;
  ddp_tensor_t value; /* owned by the model */
} ddp_buffer_t;

/* ---------------------------------------------------------------- context --------- */

DDP_API ddp_status_t ddp_ctx_create(ddp_ctx_t **out);
DDP_API void ddp_ctx_destroy(ddp_ctx_t *ctx);
/* Ends a step: every var, node and temporary of the context is released (memory is kept
 * and reused). Parameters' gradients are untouched. */
DDP_API void ddp_ctx_reset(ddp_ctx_t *ctx);
/* Grad mode (default on). Returns the previous mode, like torch.set_grad_enabled. */
DDP_API bool ddp_ctx_set_grad_enabled(ddp_ctx_t *ctx, bool enabled);
DDP_API bool ddp_ctx_grad_enabled(const ddp_ctx_t *ctx);
/* Dropout draws come from ddp_rng stream (DDP_RNG_DROPOUT, rank, step) under seed; each
 * dropout call in a step takes the next disjoint range of the stream. */
DDP_API void ddp_ctx_set_rng(ddp_ctx_t *ctx, uint64_t seed, uint32_t rank, uint64_t step);
/* Bytes the arena holds (its capacity), for tests and statistics. */
DDP_API size_t ddp_ctx_arena_bytes(const ddp_ctx_t *ctx);
/* Copies into *out the context's last error (op shape mismatches and the like; status
 * DDP_OK and "" when there is none). A context is single-owner (one thread at a time), so
 * no lock is needed. */
DDP_API void ddp_ctx_last_error_copy(const ddp_ctx_t *ctx, ddp_error_t *out);

/* A new var in the arena: zero-filled, or a copy of data (numel elements of dt). Inputs
 * and targets enter the tape this way; requires_grad makes the var a leaf that receives a
 * gradient (tests use it for input gradients). */
DDP_API ddp_status_t ddp_var_new(ddp_ctx_t *ctx, ddp_dtype_t dt, int ndim, const int64_t *shape,
                                 const void *data, bool requires_grad, ddp_var_t **out);
/* The leaf var of a parameter for this step (one per parameter per step; a checkpoint's
 * recompute gets fresh ones). NULL when the arena is exhausted. One context at a time may
 * use a model: the cache lives in the parameter. */
DDP_API ddp_var_t *ddp_param_var(ddp_ctx_t *ctx, ddp_param_t *p);

/* Backward from a scalar loss (seed gradient 1). */
DDP_API ddp_status_t ddp_backward(ddp_ctx_t *ctx, ddp_var_t *loss);
/* Backward from several roots with given gradients (grads[i] matches roots[i]'s shape and
 * dtype; NULL means ones). */
DDP_API ddp_status_t ddp_backward_multi(ddp_ctx_t *ctx, size_t n, ddp_var_t *const *roots,
                                        const ddp_tensor_t *grads);

/* Queues fn(user) to run once when the running (outermost) backward has processed every
 * node, after the last gradient-ready hook, like PyTorch's Engine.queue_callback (DDP's
 * finalize_backward and static_graph's delayed allreduce run there). Call it from a hook or
 * before ddp_backward; the queue is emptied after each backward. A callback's error ends the
 * backward with that status. At most DDP_CTX_MAX_CALLBACKS per backward
 * (DDP_ERR_INVALID_USAGE beyond). */
#define DDP_CTX_MAX_CALLBACKS 16
typedef ddp_status_t (*ddp_backward_callback_fn)(void *user);
DDP_API ddp_status_t ddp_ctx_queue_callback(ddp_ctx_t *ctx, ddp_backward_callback_fn fn,
                                            void *user);
/* True while a backward (or a checkpoint's inner backward) is running. */
DDP_API bool ddp_ctx_in_backward(const ddp_ctx_t *ctx);

/* The parameters reachable from outputs through the tape (PyTorch's graph search for
 * find_unused_parameters). visit is called once per reachable parameter that requires grad,
 * in no particular order. Parameters used only inside a checkpointed segment are not
 * reachable (their forward ran without grad), as in PyTorch's reentrant checkpoint. */
DDP_API void ddp_graph_visit_params(ddp_ctx_t *ctx, size_t n, ddp_var_t *const *outputs,
                                    void (*visit)(void *user, ddp_param_t *p), void *user);

/* Activation checkpointing with PyTorch's reentrant semantics (use_reentrant=True).
 * Forward runs fn in no-grad mode; the output requires grad when an input does. Backward
 * recomputes fn with grad (same dropout draws), runs an inner backward from the recomputed
 * output, which fires the hooks of the parameters fn uses (fire count > 1 for one also used
 * outside), and passes the input gradients on. */
typedef ddp_status_t (*ddp_segment_fn)(void *user, ddp_ctx_t *ctx, size_t nin, ddp_var_t *const *in,
                                       ddp_var_t **out);
DDP_API ddp_status_t ddp_checkpoint(ddp_ctx_t *ctx, ddp_segment_fn fn, void *user, size_t nin,
                                    ddp_var_t *const *in, ddp_var_t **out);

/* ---------------------------------------------------------------- operations ------ */
/* Every op takes float inputs of one dtype (F32 or F64; ids are I64), checks shapes
 * (DDP_ERR_INVALID_ARGUMENT with a message on the context) and records itself on the tape
 * when grad mode is on and an input requires grad. */

/* y = x @ w^T + b; x [..., in], w [out, in], b [out] or NULL. */
DDP_API ddp_status_t ddp_linear(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b,
                                ddp_var_t **y);
/* y = a @ b; a [m, k], b [k, n]. */
DDP_API ddp_status_t ddp_matmul(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y);
/* Elementwise, same shapes. ddp_add also broadcasts b when b's shape, without leading dims
 * of size 1, equals the trailing dims of a's (a [B, T, C] + b [T, C]); b's gradient is then
 * summed over the repeated dims. */
DDP_API ddp_status_t ddp_add(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y);
DDP_API ddp_status_t ddp_mul(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y);
/* y = x + b broadcast over the last dim; b [x.shape[-1]]. */
DDP_API ddp_status_t ddp_bias_add(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *b, ddp_var_t **y);

typedef enum ddp_act {
  DDP_ACT_RELU = 0,
  DDP_ACT_GELU = 1,      /* erf form (approximate='none') */
  DDP_ACT_GELU_TANH = 2, /* approximate='tanh' */
  DDP_ACT_TANH = 3,
  DDP_ACT_SIGMOID = 4,
  DDP_ACT_SILU = 5 /* x * sigmoid(x) (Transformers' "silu", Llama's MLP) */
} ddp_act_t;
DDP_API ddp_status_t ddp_activation(ddp_ctx_t *c, ddp_act_t act, ddp_var_t *x, ddp_var_t **y);
DDP_API ddp_status_t ddp_relu(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y);

/* Over the last dim. */
DDP_API ddp_status_t ddp_softmax(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y);
DDP_API ddp_status_t ddp_log_softmax(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y);
/* Inverted dropout: kept elements are scaled by 1/(1-p). Identity when !training or p == 0;
 * p == 1 gives zeros. */
DDP_API ddp_status_t ddp_dropout(ddp_ctx_t *c, ddp_var_t *x, double p, bool training,
                                 ddp_var_t **y);
/* Over the last dim; w, b [x.shape[-1]] or NULL. */
DDP_API ddp_status_t ddp_layer_norm(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b,
                                    double eps, ddp_var_t **y);
/* x [N, C]. training: normalise with the batch's biased variance and update the running
 * stats (running = (1 - momentum) * running + momentum * batch, the variance unbiased,
 * num_batches_tracked += 1); else normalise with the running stats. Running tensors may be
 * NULL (track_running_stats=False). */
DDP_API ddp_status_t ddp_batch_norm(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b,
                                    ddp_tensor_t *running_mean, ddp_tensor_t *running_var,
                                    ddp_tensor_t *num_batches_tracked, bool training,
                                    double momentum, double eps, ddp_var_t **y);
/* ids I64 of any shape, weight [V, D]; y = ids.shape + [D]. Out-of-range ids are an error. */
DDP_API ddp_status_t ddp_embedding(ddp_ctx_t *c, ddp_var_t *ids, ddp_var_t *weight, ddp_var_t **y);
/* Same numel; one dim may be -1. */
DDP_API ddp_status_t ddp_reshape(ddp_ctx_t *c, ddp_var_t *x, int ndim, const int64_t *shape,
                                 ddp_var_t **y);
/* Concatenates n vars along dim (all other dims equal). */
DDP_API ddp_status_t ddp_concat(ddp_ctx_t *c, size_t n, ddp_var_t *const *xs, int dim,
                                ddp_var_t **y);
/* Full reductions to a scalar. */
DDP_API ddp_status_t ddp_sum(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y);
DDP_API ddp_status_t ddp_mean(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y);
/* mean((a - b)^2). */
DDP_API ddp_status_t ddp_mse_loss(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y);
/* logits [N, C], targets I64 [N]; mean over targets != ignore_index (PyTorch: -100).
 * All targets ignored gives NaN, as in PyTorch. */
DDP_API ddp_status_t ddp_cross_entropy(ddp_ctx_t *c, ddp_var_t *logits, ddp_var_t *targets,
                                       int64_t ignore_index, ddp_var_t **y);

/* Transformer operations (GPT-2, BERT). Same rules as above: F32 or F64 (ids, labels and
 * masks I64), shape errors as DDP_ERR_INVALID_ARGUMENT with a message, gradients
 * accumulated (+=), matrix work through ddp_gemm. Outputs are new contiguous tensors. */

/* y = x @ w + b with w stored [in, out] (Transformers' Conv1D); x [..., in], b [out] or
 * NULL; y [..., out]. Parameters fire bias first, then weight (PyTorch's addmm order). */
DDP_API ddp_status_t ddp_conv1d(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b,
                                ddp_var_t **y);
/* Batched matmul over equal leading dims: a [..., m, k], b [..., k, n] (or [..., n, k] when
 * trans_b) -> [..., m, n]; one gemm per leading index. */
DDP_API ddp_status_t ddp_bmm(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, bool trans_b, ddp_var_t **y);
/* y = x.permute(perm) as a contiguous copy; perm has x.ndim entries, each dim once
 * (negative entries count from the end). */
DDP_API ddp_status_t ddp_permute(ddp_ctx_t *c, ddp_var_t *x, const int *perm, ddp_var_t **y);
/* y = x.narrow(dim, start, length) as a contiguous copy; dim and start may be negative
 * (counted from the end). start + length beyond the dim's size is an error. */
DDP_API ddp_status_t ddp_narrow(ddp_ctx_t *c, ddp_var_t *x, int dim, int64_t start, int64_t length,
                                ddp_var_t **y);
/* y = x * s, with s rounded to x's dtype. */
DDP_API ddp_status_t ddp_scale(ddp_ctx_t *c, ddp_var_t *x, double s, ddp_var_t **y);
/* Fused QKV split: x [B, T, 3C] -> q, k, v each [B, n_head, T, C/n_head]: q from the first C
 * columns, then k, then v (Transformers' GPT-2 split and _split_heads). C not divisible by
 * n_head is an error. */
DDP_API ddp_status_t ddp_split_heads(ddp_ctx_t *c, ddp_var_t *x, int64_t n_head, ddp_var_t **q,
                                     ddp_var_t **k, ddp_var_t **v);
/* One projection's heads: x [B, T, C] -> [B, n_head, T, C/n_head] (BERT's query/key/value). */
DDP_API ddp_status_t ddp_to_heads(ddp_ctx_t *c, ddp_var_t *x, int64_t n_head, ddp_var_t **y);
/* Heads merged back: x [B, H, T, D] -> [B, T, H*D]. */
DDP_API ddp_status_t ddp_merge_heads(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y);
/* Scaled dot-product attention, q, k, v [B, H, T, D] -> [B, H, T, D]:
 * scores = q k^T * scale; when causal, key j > query i is masked; key_mask is NULL or I64/F32
 * [B, T] with 1 = attend, 0 = padding (masked for every query). Masked scores take the
 * dtype's most negative finite value (Transformers' choice; a row with every key masked
 * gets uniform probabilities). Softmax over keys with the max subtracted (exp in double,
 * probabilities rounded to the dtype). When training and dropout_p > 0, dropout on the
 * probabilities drawn exactly as ddp_dropout on a [B, H, T, T] tensor (same Philox stream,
 * takes the next dropout call of the step). Then probs @ v. Saves only the probabilities
 * for backward. */
DDP_API ddp_status_t ddp_attention(ddp_ctx_t *c, ddp_var_t *q, ddp_var_t *k, ddp_var_t *v,
                                   ddp_var_t *key_mask, bool causal, double scale, double dropout_p,
                                   bool training, ddp_var_t **y);
/* Causal-LM loss as Transformers' GPT2LMHeadModel: logits [B, T, V], labels I64 [B, T];
 * position t's logits predict labels[t + 1]; mean cross-entropy over the B*(T-1) pairs whose
 * label is not ignore_index (-100); no counted pair gives NaN. A label outside [0, V) other
 * than ignore_index (labels[:, 0] is never read) is "Target t is out of bounds". */
DDP_API ddp_status_t ddp_causal_lm_loss(ddp_ctx_t *c, ddp_var_t *logits, ddp_var_t *labels,
                                        int64_t ignore_index, ddp_var_t **y);

/* Llama operations (src/nn/ops_llama.c), as Transformers' modeling_llama.py computes them. */

/* Llama's RMSNorm over the last dim: y = w * (x * rsqrt(mean(x^2) + eps)); w [x.shape[-1]]
 * or NULL. The statistics are taken in double, the output rounded to x's dtype once. */
DDP_API ddp_status_t ddp_rms_norm(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, double eps,
                                  ddp_var_t **y);
/* rope_scaling's "rope_type" (or "type"): none/"default", "linear", "dynamic", "llama3". */
typedef enum ddp_rope_type {
  DDP_ROPE_DEFAULT = 0,
  DDP_ROPE_LINEAR = 1,
  DDP_ROPE_DYNAMIC = 2,
  DDP_ROPE_LLAMA3 = 3
} ddp_rope_type_t;
typedef struct ddp_rope_scaling {
  ddp_rope_type_t type;
  double factor;                            /* LINEAR, DYNAMIC, LLAMA3 */
  int64_t original_max_position_embeddings; /* LLAMA3 */
  double low_freq_factor, high_freq_factor; /* LLAMA3 */
} ddp_rope_scaling_t;
/* Transformers' inverse frequencies for head_dim (even) and a sequence of seq_len tokens:
 * inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim / 2, then the scaling (s NULL: none):
 * LINEAR divides by factor; DYNAMIC, only when seq_len > max_position_embeddings, uses the
 * base theta * (factor * seq_len / max_pos - (factor - 1))^(d / (d - 2)); LLAMA3 keeps the
 * wavelengths below original_max / high_freq_factor, divides those above
 * original_max / low_freq_factor by factor and interpolates between. Computed in double and
 * rounded to float once (Transformers keeps inv_freq in float32). */
DDP_API void ddp_rope_inv_freq(double theta, int64_t head_dim, const ddp_rope_scaling_t *s,
                               int64_t max_position_embeddings, int64_t seq_len, float *inv_freq);
/* Rotary position embedding of x [B, H, T, D] at positions 0..T-1, rotate-half layout:
 * with h = D / 2, f = fl32(inv_freq[j] * t), c = fl32(cos f), s = fl32(sin f) (float32 tables,
 * as Transformers computes them, widened to x's dtype): y[j] = x[j] c - x[j + h] s and
 * y[j + h] = x[j + h] c + x[j] s, each product and sum rounded in x's dtype. inv_freq holds
 * D / 2 floats (copied). */
DDP_API ddp_status_t ddp_rotary(ddp_ctx_t *c, ddp_var_t *x, const float *inv_freq, ddp_var_t **y);
/* Transformers' repeat_kv: x [B, KV, T, D] -> y [B, KV * n_rep, T, D], head h of y being head
 * h / n_rep of x (grouped-query attention); the gradient sums over the repeats. */
DDP_API ddp_status_t ddp_repeat_kv(ddp_ctx_t *c, ddp_var_t *x, int64_t n_rep, ddp_var_t **y);

/* ---------------------------------------------------------------- models ---------- */

DDP_API ddp_status_t ddp_model_create(ddp_model_t **out);
DDP_API void ddp_model_destroy(ddp_model_t *m);

/* Building: register parameters and buffers (before ddp_model_finalize), then finalize,
 * which lays out the flat buffers in registration order and points the views. Names must be
 * unique (DDP_ERR_INVALID_ARGUMENT). Values start at zero. */
DDP_API ddp_status_t ddp_model_add_param(ddp_model_t *m, const char *name, ddp_dtype_t dt, int ndim,
                                         const int64_t *shape, bool requires_grad, size_t *index);
DDP_API ddp_status_t ddp_model_add_buffer(ddp_model_t *m, const char *name, ddp_dtype_t dt,
                                          int ndim, const int64_t *shape, size_t *index);
DDP_API ddp_status_t ddp_model_finalize(ddp_model_t *m);
DDP_API bool ddp_model_finalized(const ddp_model_t *m);

DDP_API size_t ddp_model_num_params(const ddp_model_t *m);
DDP_API ddp_param_t *ddp_model_param(ddp_model_t *m, size_t i);
DDP_API ddp_param_t *ddp_model_find_param(ddp_model_t *m, const char *name);
/* Whether parameter `index` is the weight or bias of a LayerNorm module, or a Llama RMSNorm
 * weight (Hugging Face's Trainer exempts those from weight decay). */
DDP_API bool ddp_model_param_in_layer_norm(const ddp_model_t *m, size_t index);
DDP_API size_t ddp_model_num_buffers(const ddp_model_t *m);
DDP_API ddp_buffer_t *ddp_model_buffer(ddp_model_t *m, size_t i);
DDP_API ddp_buffer_t *ddp_model_find_buffer(ddp_model_t *m, const char *name);
/* The flat buffers of one dtype (numel 0 / NULL when the model has none of it). */
DDP_API ddp_tensor_t ddp_model_flat_params(ddp_model_t *m, ddp_dtype_t dt);
DDP_API ddp_tensor_t ddp_model_flat_grads(ddp_model_t *m, ddp_dtype_t dt);
/* Points p->grad at data (numel elements of p's dtype), e.g. into a DDP bucket; NULL
 * restores the view into the model's flat gradient buffer (which defines a None gradient,
 * with whatever values that storage holds). The caller keeps data alive. */
DDP_API void ddp_param_set_grad_data(ddp_param_t *p, void *data);
/* p.grad = None: p->grad.data becomes NULL; dtype and shape stay. The next backward that
 * reaches p defines it again (zeros in the flat gradient buffer, then accumulation). */
DDP_API void ddp_param_set_grad_none(ddp_param_t *p);
/* p.grad = None, and the memory of its storage in the model's flat gradient buffer (the
 * whole pages inside p's slice) handed back to the operating system (madvise
 * MADV_DONTNEED), as freeing PyTorch's .grad frees it: what ZeRO-2 does with the gradients
 * of parameters another rank owns once they are reduced. The next backward that reaches p
 * defines it again (zeros, then accumulation) and the pages come back. */
DDP_API void ddp_param_release_grad(ddp_param_t *p);
/* Whether p's gradient is defined (PyTorch: p.grad is not None). */
DDP_API bool ddp_param_grad_defined(const ddp_param_t *p);
DDP_API void ddp_param_set_hook(ddp_param_t *p, ddp_grad_ready_fn fn, void *user);
/* Sets the same hook on every parameter. */
DDP_API void ddp_model_set_hook(ddp_model_t *m, ddp_grad_ready_fn fn, void *user);
/* Zero-fills every defined gradient (wherever it points); None ones stay None, as
 * module.zero_grad(set_to_none=False) does. A finalized model starts with defined zero
 * gradients (unlike a fresh PyTorch module, whose gradients are None). */
DDP_API void ddp_model_zero_grad(ddp_model_t *m);
/* module.zero_grad(set_to_none=True): every gradient becomes None. */
DDP_API void ddp_model_set_grads_none(ddp_model_t *m);

/* Modules. Each constructor registers its parameters and buffers under the prefix (the
 * module's state_dict path, "" for a root module) and returns a module owned by the model.
 * Call them in PyTorch's __init__ order so that parameters() orders match. */
DDP_API ddp_status_t ddp_module_linear(ddp_model_t *m, const char *prefix, int64_t in, int64_t out,
                                       bool bias, ddp_dtype_t dt, ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_layer_norm(ddp_model_t *m, const char *prefix, int64_t dim,
                                           double eps, ddp_dtype_t dt, ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_batch_norm(ddp_model_t *m, const char *prefix, int64_t dim,
                                           double eps, double momentum, ddp_dtype_t dt,
                                           ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_embedding(ddp_model_t *m, const char *prefix, int64_t num,
                                          int64_t dim, ddp_dtype_t dt, ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_dropout(ddp_model_t *m, double p, ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_activation(ddp_model_t *m, ddp_act_t act, ddp_module_t **mod);
/* x [N, ...] -> [N, prod(...)] (nn.Flatten). */
DDP_API ddp_status_t ddp_module_flatten(ddp_model_t *m, ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_sequential(ddp_model_t *m, ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_append(ddp_module_t *seq, ddp_module_t *child);
/* y = x + body(x). */
DDP_API ddp_status_t ddp_module_residual(ddp_model_t *m, ddp_module_t *body, ddp_module_t **mod);
/* y = body(x) when bit `flag` of the forward's flags is set, else y = x (a layer used only
 * for some batches: the unused-parameter case). */
DDP_API ddp_status_t ddp_module_branch(ddp_model_t *m, ddp_module_t *body, unsigned flag,
                                       ddp_module_t **mod);
/* Runs body as one reentrant activation-checkpointing segment (ddp_checkpoint). */
DDP_API ddp_status_t ddp_module_checkpointed(ddp_model_t *m, ddp_module_t *body,
                                             ddp_module_t **mod);
/* y = the sum of its branches' outputs on the same input, left to right
 * (((b0(x) + b1(x)) + b2(x)) ...), the branches added with ddp_module_add_branch. A branch
 * with flag f >= 0 runs (and is added) only when bit f of the forward's flags is set; -1
 * always. No active branch is DDP_ERR_INVALID_ARGUMENT at forward. At most
 * DDP_ADD_MAX_BRANCHES branches. */
#define DDP_ADD_MAX_BRANCHES 16
DDP_API ddp_status_t ddp_module_add(ddp_model_t *m, ddp_module_t **mod);
DDP_API ddp_status_t ddp_module_add_branch(ddp_module_t *add, ddp_module_t *body, int flag);

DDP_API void ddp_model_set_root(ddp_model_t *m, ddp_module_t *root);
/* train(true) / eval(false): dropout and batch norm read it. Default: training. */
DDP_API void ddp_model_train(ddp_model_t *m, bool training);
DDP_API ddp_status_t ddp_module_forward(ddp_module_t *mod, ddp_ctx_t *ctx, ddp_var_t *x,
                                        uint64_t flags, ddp_var_t **y);
DDP_API ddp_status_t ddp_model_forward(ddp_model_t *m, ddp_ctx_t *ctx, ddp_var_t *x, uint64_t flags,
                                       ddp_var_t **y);

/* Blocks: the modules a sharding wrap policy may make units of (FSDP's auto_wrap), in
 * forward order. A Transformers family registers one per layer, class named as
 * Transformers names it ("GPT2Block", "BertLayer", "LlamaDecoderLayer"); a Sequential
 * root offers each child holding parameters, class named by its kind ("Linear",
 * "LayerNorm", "Sequential", ...). Block k holds parameters first .. first + count - 1.
 * Everything else belongs to no block (the root unit). */
DDP_API size_t ddp_model_num_blocks(ddp_model_t *m);
DDP_API void ddp_model_block(ddp_model_t *m, size_t k, const char **cls, size_t *first,
                             size_t *count);

/* Calls around block k, for sharding (nn never calls the shard layer: the caller passes
 * this table). pre_forward runs before the block's forward, post_forward after it;
 * pre_backward when backward reaches the block's output (before any of its ops' backward),
 * post_backward when backward has passed the block's input (every gradient of its
 * parameters is then final). A block whose input needs no gradient (the first layer of an
 * MLP) gets no post_backward: the caller finishes it after backward. A hook may point its
 * parameters' value.data at new storage: the parameter leaves of the running backward are
 * re-read after pre_backward. A failing hook's status stops the forward or backward (its
 * message is the caller's). NULL clears; the table is copied. */
typedef struct ddp_block_hooks {
  void *user;
  ddp_status_t (*pre_forward)(void *user, size_t block);
  ddp_status_t (*post_forward)(void *user, size_t block);
  ddp_status_t (*pre_backward)(void *user, size_t block);
  ddp_status_t (*post_backward)(void *user, size_t block);
} ddp_block_hooks_t;
DDP_API void ddp_model_set_block_hooks(ddp_model_t *m, const ddp_block_hooks_t *hooks);

/* Frees the model's flat parameter and gradient buffers: every parameter's value.data and
 * grad.data become NULL until a caller (the shard layer) points them at storage it owns.
 * Irreversible; ddp_model_flat_params/grads are empty from then on. */
DDP_API void ddp_model_release_storage(ddp_model_t *m);
/* After release: new flat buffers (zeros), every parameter pointing into them again. */
DDP_API ddp_status_t ddp_model_restore_storage(ddp_model_t *m);

/* PyTorch's default initialisation of every module, drawn from ddp_rng stream
 * (DDP_RNG_INIT, 0, 0) under seed in registration order: Linear weight and bias
 * U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform with a = sqrt(5)); LayerNorm and
 * BatchNorm weight 1, bias 0; Embedding N(0, 1); running_var 1, others 0. */
DDP_API ddp_status_t ddp_model_init(ddp_model_t *m, uint64_t seed);

/* state_dict order (PyTorch's): per module its parameters, then its buffers, then the
 * children's, which is registration order here. */
DDP_API ddp_status_t ddp_model_save(ddp_model_t *m, const char *path, ddp_error_t *err);
/* Loads by name. Shape mismatch is always an error ("size mismatch for 0.weight: ...");
 * floating dtypes convert, float <-> integer is an error. With strict, missing and
 * unexpected keys are an error listing both, worded like PyTorch's; without strict they are
 * reported in the counts only. Nothing is modified unless the whole load succeeds. */
DDP_API ddp_status_t ddp_model_load(ddp_model_t *m, const char *path, bool strict,
                                    size_t *n_missing, size_t *n_unexpected, ddp_error_t *err);

/* Builds a model from a JSON description (docs/nn.md): a top-level Sequential whose
 * layers may carry a "name" (the state_dict key instead of the position) and may be "add"
 * nodes summing sub-networks. */
DDP_API ddp_status_t ddp_model_from_json(const char *json, ddp_model_t **out, ddp_error_t *err);
DDP_API ddp_status_t ddp_model_from_json_file(const char *path, ddp_model_t **out,
                                              ddp_error_t *err);

/* ---------------------------------------------------------------- Transformers ---- */
/* Hugging Face Transformers' GPT2LMHeadModel and BertForSequenceClassification (docs/nn.md,
 * "Transformers"): the same parameters, state_dict names, parameters() order, forward and
 * _init_weights distributions, built from a config.json and stored as save_pretrained does.
 * ddp_model_forward takes I64 token ids: GPT-2 [B, T] -> logits [B, T, vocab_size]; BERT
 * [B, T] ids, [B, 2, T] (ids, attention_mask) or [B, 3, T] (plus token_type_ids) -> logits
 * [B, num_labels]. ddp_model_init(m, seed) draws Transformers' initialisation. */

typedef enum ddp_hf_model_type {
  DDP_HF_NONE = 0,
  DDP_HF_GPT2 = 1, /* "gpt2": GPT2LMHeadModel */
  DDP_HF_BERT = 2, /* "bert": BertForSequenceClassification */
  DDP_HF_LLAMA = 3 /* "llama": LlamaForCausalLM (Llama 1-3, SmolLM, TinyLlama) */
} ddp_hf_model_type_t;

#define DDP_HF_NAME_MAX 32
#define DDP_HF_EXTRA_MAX 16384

/* config.json keys of GPT-2, with Transformers' defaults. */
typedef struct ddp_gpt2_config {
  int64_t vocab_size;                        /* 50257 */
  int64_t n_positions;                       /* 1024: the longest sequence */
  int64_t n_embd;                            /* 768 */
  int64_t n_layer;                           /* 12 */
  int64_t n_head;                            /* 12; must divide n_embd */
  int64_t n_inner;                           /* 0 = null: 4 * n_embd */
  char activation_function[DDP_HF_NAME_MAX]; /* "gelu_new" */
  double resid_pdrop;                        /* 0.1 */
  double embd_pdrop;                         /* 0.1 */
  double attn_pdrop;                         /* 0.1 */
  double layer_norm_epsilon;                 /* 1e-5 */
  double initializer_range;                  /* 0.02 */
  bool scale_attn_weights;                   /* true: scores / sqrt(head size) */
  bool scale_attn_by_inverse_layer_idx;      /* false: also / (layer index + 1) */
  bool reorder_and_upcast_attn;              /* false; true computes the same function */
  bool tie_word_embeddings;                  /* true: lm_head.weight is transformer.wte.weight */
} ddp_gpt2_config_t;

/* config.json keys of BERT, with Transformers' defaults. */
typedef struct ddp_bert_config {
  int64_t vocab_size;                  /* 30522 */
  int64_t hidden_size;                 /* 768 */
  int64_t num_hidden_layers;           /* 12 */
  int64_t num_attention_heads;         /* 12; must divide hidden_size */
  int64_t intermediate_size;           /* 3072 */
  char hidden_act[DDP_HF_NAME_MAX];    /* "gelu" (erf) */
  double hidden_dropout_prob;          /* 0.1 */
  double attention_probs_dropout_prob; /* 0.1 */
  int64_t max_position_embeddings;     /* 512: the longest sequence */
  int64_t type_vocab_size;             /* 2 */
  double layer_norm_eps;               /* 1e-12 */
  double initializer_range;            /* 0.02 */
  int64_t pad_token_id;                /* 0; -1 = null (no padding row) */
  int64_t num_labels;                  /* 2 ("num_labels", or the size of "id2label") */
  double classifier_dropout;           /* -1 = null: hidden_dropout_prob */
  char problem_type[DDP_HF_NAME_MAX];  /* "" = null, "regression", "single_label_classification" */
} ddp_bert_config_t;

/* config.json keys of Llama (LlamaConfig), with Transformers' defaults. */
typedef struct ddp_llama_config {
  int64_t vocab_size;               /* 32000 */
  int64_t hidden_size;              /* 4096 */
  int64_t intermediate_size;        /* 11008 */
  int64_t num_hidden_layers;        /* 32 */
  int64_t num_attention_heads;      /* 32 */
  int64_t num_key_value_heads;      /* null = num_attention_heads; must divide it */
  int64_t head_dim;                 /* null = hidden_size / num_attention_heads; even */
  char hidden_act[DDP_HF_NAME_MAX]; /* "silu" */
  int64_t max_position_embeddings;  /* 2048 (a longer sequence is allowed, as in Transformers) */
  double initializer_range;         /* 0.02 */
  double rms_norm_eps;              /* 1e-6 */
  int64_t pad_token_id;             /* -1 = null; else that embedding row starts at zero */
  int64_t bos_token_id;             /* 1 */
  int64_t eos_token_id;             /* 2 */
  bool tie_word_embeddings;         /* false */
  double rope_theta;                /* 10000 */
  ddp_rope_scaling_t rope_scaling;  /* null: DDP_ROPE_DEFAULT */
  bool attention_bias;              /* false: q/k/v/o_proj without bias */
  double attention_dropout;         /* 0.0 */
  bool mlp_bias;                    /* false: gate/up/down_proj without bias */
} ddp_llama_config_t;

typedef struct ddp_hf_config {
  ddp_hf_model_type_t model_type; /* "model_type" */
  ddp_dtype_t torch_dtype;        /* "torch_dtype": F64 for "float64", else F32; a model
                                   * reports its own dtype here */
  ddp_gpt2_config_t gpt2;         /* model_type GPT2 */
  ddp_bert_config_t bert;         /* model_type BERT */
  ddp_llama_config_t llama;       /* model_type LLAMA */
  /* The keys of the parsed config.json that libddp does not model (bos_token_id,
   * eos_token_id, task_specific_params, custom keys), and id2label/label2id as given, as
   * one JSON object ("" when none): ddp_hf_config_write writes them back, as
   * save_pretrained keeps every attribute of a config. */
  char extra[DDP_HF_EXTRA_MAX];
} ddp_hf_config_t;

typedef enum ddp_model_task {
  DDP_TASK_DEFAULT = 0,           /* loss chosen by the label dtype (the MLP files) */
  DDP_TASK_CAUSAL_LM = 1,         /* GPT2LMHeadModel, LlamaForCausalLM: ddp_causal_lm_loss */
  DDP_TASK_SEQ_CLASSIFICATION = 2 /* BertForSequenceClassification: CE (num_labels > 1) or
                                   * MSE (num_labels == 1) on logits [B, num_labels] */
} ddp_model_task_t;

DDP_API ddp_model_task_t ddp_model_task(const ddp_model_t *m);
/* The Transformers configuration of a GPT-2/BERT model (NULL for other models). */
DDP_API const ddp_hf_config_t *ddp_model_hf_config(const ddp_model_t *m);
/* The loss of m's task on its logits: CAUSAL_LM ddp_causal_lm_loss(logits, labels I64
 * [B, T], -100); SEQ_CLASSIFICATION cross-entropy on I64 labels [B], or, for a regression
 * head (num_labels == 1 or problem_type "regression"), MSE on float labels with as many
 * values as the logits (Transformers' problem_type rule); DEFAULT cross-entropy for I64
 * labels, MSE otherwise. */
DDP_API ddp_status_t ddp_model_loss(ddp_model_t *m, ddp_ctx_t *ctx, ddp_var_t *logits,
                                    ddp_var_t *labels, ddp_var_t **loss);

/* Transformers' defaults for model_type (DDP_HF_GPT2 or DDP_HF_BERT), torch_dtype F32. */
DDP_API void ddp_hf_config_defaults(ddp_hf_config_t *cfg, ddp_hf_model_type_t model_type);
/* Checks a config: positive sizes, heads dividing the width, probabilities in [0, 1], a known
 * activation. DDP_ERR_INVALID_ARGUMENT naming the key; DDP_ERR_UNSUPPORTED for valid
 * Transformers settings libddp does not implement. */
DDP_API ddp_status_t ddp_hf_config_check(const ddp_hf_config_t *cfg, const char *path,
                                         ddp_error_t *err);
/* config.json text -> config (Transformers' keys and defaults; the keys libddp does not model
 * are kept in cfg->extra, as Transformers keeps them as plain attributes; more than
 * DDP_HF_EXTRA_MAX bytes of them is DDP_ERR_UNSUPPORTED naming the size). An unknown model_type, a
 * wrong JSON type, n_embd % n_head != 0 and the like are DDP_ERR_INVALID_ARGUMENT naming the key;
 * settings that change the model in ways libddp does not implement are DDP_ERR_UNSUPPORTED. path
 * only names the source in messages (may be NULL). */
DDP_API ddp_status_t ddp_hf_config_parse(const char *json, const char *path, ddp_hf_config_t *cfg,
                                         ddp_error_t *err);
/* Writes config.json as save_pretrained does (sorted keys, "architectures", "model_type",
 * "torch_dtype", BERT's id2label/label2id), with the keys kept in cfg->extra (which win over
 * the generated id2label/label2id), atomically. */
DDP_API ddp_status_t ddp_hf_config_write(const ddp_hf_config_t *cfg, const char *path,
                                         ddp_error_t *err);
/* The same config.json text (no trailing newline) into *out, freed with ddp_free. */
DDP_API ddp_status_t ddp_hf_config_to_json(const ddp_hf_config_t *cfg, char **out,
                                           ddp_error_t *err);
/* A finalized model (zero weights: call ddp_model_init) of dtype dt (F32 or F64). */
DDP_API ddp_status_t ddp_model_from_hf_config(const ddp_hf_config_t *cfg, ddp_dtype_t dt,
                                              ddp_model_t **out, ddp_error_t *err);
/* DIR/config.json + the weights: DIR/model.safetensors, or else the shards that
 * DIR/model.safetensors.index.json names ({"metadata": {"total_size": N}, "weight_map":
 * {tensor: file}}), as Transformers' from_pretrained looks for them. Strict by name with
 * PyTorch's wording, except what Transformers tolerates: the transformer.h.N.attn.bias /
 * attn.masked_bias, bert.embeddings.position_ids and Llama's rotary_emb.inv_freq buffers are
 * ignored, a tied lm_head.weight must only match in shape (wte's values are used), and a
 * base-model checkpoint's keys (no "transformer." / "bert." prefix) get the prefix. Floating
 * dtypes convert to dt. A sharded directory is checked whole before anything is copied: a
 * file the index names that is absent (DDP_ERR_NOT_FOUND), a tensor the index does not list,
 * one that sits in another file than the index says, or one the index lists in a file that
 * lacks it (DDP_ERR_INVALID_DATA) are errors naming the file and the tensor. */
DDP_API ddp_status_t ddp_model_from_pretrained(const char *dir, ddp_dtype_t dt, ddp_model_t **out,
                                               ddp_error_t *err);
/* The weights of DIR (as ddp_model_from_pretrained reads them, single file or sharded) into
 * an existing Transformers model m built from the same config; config.json is not read. A
 * failed load leaves m untouched. */
DDP_API ddp_status_t ddp_model_load_pretrained(ddp_model_t *m, const char *dir, ddp_error_t *err);

/* save_pretrained's default max_shard_size ("5GB", Transformers 4.35 and later). */
#define DDP_MAX_SHARD_SIZE_DEFAULT 5000000000LL
/* Transformers' convert_file_size_to_int: "5GB" (10^9), "10MB", "100KB", "2GiB", "64MiB",
 * "512KiB", a trailing lower-case "b" meaning bits ("40Mb" = 5 MB), or plain bytes "12345".
 * Anything else, or a size < 1, is DDP_ERR_INVALID_ARGUMENT naming `what` (the flag or
 * parameter) and the value. */
DDP_API ddp_status_t ddp_parse_file_size(const char *text, const char *what, int64_t *bytes,
                                         ddp_error_t *err);
/* Writes DIR/config.json and the state_dict (metadata {"format": "pt"}; the tied
 * lm_head.weight left out), as save_pretrained(max_shard_size="5GB") does; creates DIR (and
 * its parents). */
DDP_API ddp_status_t ddp_model_save_pretrained(ddp_model_t *m, const char *dir, ddp_error_t *err);
/* The same with Transformers' max_shard_size in bytes (> 0): tensors go in state_dict order
 * into model-0000K-of-0000N.safetensors files, a new file starting when the next tensor
 * would take the current one over max_shard_size (a tensor larger than that gets a file of
 * its own), and model.safetensors.index.json lists them (keys sorted, indent 2, as
 * Transformers writes it); with one file it is model.safetensors and no index. Files of an
 * earlier save that the new one does not write (model-*-of-*.safetensors, and the single file
 * or the index of the other layout) are removed, so from_pretrained cannot pick stale ones. */
DDP_API ddp_status_t ddp_model_save_pretrained_sharded(ddp_model_t *m, const char *dir,
                                                       int64_t max_shard_size, ddp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif /* DDP_NN_H */
