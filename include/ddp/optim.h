/* libddp optim layer: SGD, Adam and AdamW with PyTorch 1.13's exact update arithmetic,
 * gradient clipping by norm, zero_grad, optimizer state in safetensors, and Hugging Face's
 * learning-rate schedules (transformers.get_scheduler).
 *
 * An optimizer works over an array of (parameter, gradient) tensor pairs that the caller
 * owns and keeps alive for the optimizer's lifetime: nn modules, DDP's flat buffers, or
 * plain tensors. Parameters and gradients are f32 or f64, contiguous, of equal shape.
 * A gradient whose data is NULL is "None" in PyTorch's sense: step() skips that parameter
 * (no state is created or advanced), as torch does for p.grad is None.
 *
 * Arithmetic (docs/optim.md has the derivation): every per-element operation rounds where
 * the corresponding ATen CPU kernel rounds, including its fused multiply-adds, and every
 * Python-side scalar (lr, bias corrections, 1 - beta) is computed in double exactly as
 * the torch/optim modules computes it, then converted to the tensor's dtype. For f32 the result
 * is bitwise equal to torch.optim in 1.13 (foreach=False, the 1.13 default).
 *
 * Thread-safety: one optimizer is used by one thread at a time. Nothing here blocks. */
#ifndef DDP_OPTIM_H
#define DDP_OPTIM_H

#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- optimizers ------ */

typedef enum ddp_optim_kind {
  DDP_OPTIM_SGD = 0,
  DDP_OPTIM_ADAM = 1,
  DDP_OPTIM_ADAMW = 2
} ddp_optim_kind_t;

/* Hyper-parameters of one optimizer (one parameter group). Fields a kind does not use are
 * ignored. Start from DDP_SGD_OPTIONS_INIT, DDP_ADAM_OPTIONS_INIT or DDP_ADAMW_OPTIONS_INIT
 * (PyTorch 1.13's defaults; torch.optim.SGD has no default lr, libddp uses 1e-3). */
typedef struct ddp_optim_options {
  size_t struct_size;
  ddp_optim_kind_t kind;
  double lr;
  double weight_decay; /* SGD/Adam: L2 added to the gradient; AdamW: decoupled decay */
  bool maximize;
  /* SGD */
  double momentum;
  double dampening;
  bool nesterov; /* requires momentum > 0 and dampening == 0, as in torch */
  /* Adam, AdamW */
  double beta1;
  double beta2;
  double eps;
  bool amsgrad;
} ddp_optim_options_t;

#define DDP_SGD_OPTIONS_INIT                                                                   \
  {                                                                                            \
    sizeof(ddp_optim_options_t), DDP_OPTIM_SGD, 1e-3, 0.0, false, 0.0, 0.0, false, 0.9, 0.999, \
        1e-8, false                                                                            \
  }
#define DDP_ADAM_OPTIONS_INIT                                                                   \
  {                                                                                             \
    sizeof(ddp_optim_options_t), DDP_OPTIM_ADAM, 1e-3, 0.0, false, 0.0, 0.0, false, 0.9, 0.999, \
        1e-8, false                                                                             \
  }
#define DDP_ADAMW_OPTIONS_INIT                                                                    \
  {                                                                                               \
    sizeof(ddp_optim_options_t), DDP_OPTIM_ADAMW, 1e-3, 1e-2, false, 0.0, 0.0, false, 0.9, 0.999, \
        1e-8, false                                                                               \
  }

/* One parameter and its gradient. Both pointers stay the caller's; the optimizer reads
 * them at every step, so the caller may swap the tensors' data between steps. */
typedef struct ddp_optim_param {
  ddp_tensor_t *param;
  ddp_tensor_t *grad;
} ddp_optim_param_t;

typedef struct ddp_optim ddp_optim_t;

/* Validates the options the way torch's constructors do (lr >= 0, eps >= 0, betas in
 * [0, 1), momentum >= 0, weight_decay >= 0, nesterov needs momentum > 0 and dampening 0)
 * and the parameters (f32/f64, param and grad of one dtype and numel); the message names
 * the offending value or parameter index. The pair array is copied. */
DDP_API ddp_status_t ddp_optim_create(const ddp_optim_options_t *opts,
                                      const ddp_optim_param_t *params, size_t nparams,
                                      ddp_optim_t **out, ddp_error_t *err);
/* Frees the optimizer and its state; NULL is a no-op. The tensors stay the caller's. */
DDP_API void ddp_optim_destroy(ddp_optim_t *opt);

/* One update of every parameter whose grad is present. DDP_ERR_INVALID_ARGUMENT when a
 * tensor's shape or dtype changed since create (the message names its index). */
DDP_API ddp_status_t ddp_optim_step(ddp_optim_t *opt, ddp_error_t *err);

/* Zero-fills every present gradient (set_to_none = false, the 1.13 default), or makes each
 * gradient None when true: its data becomes NULL (freed when the tensor owns it) and its
 * dtype and shape stay, so a model's backward can define it again. A None gradient stays
 * None either way. */
DDP_API void ddp_optim_zero_grad(ddp_optim_t *opt, bool set_to_none);

/* The learning rate of the next step (a scheduler sets it before each step). */
DDP_API void ddp_optim_set_lr(ddp_optim_t *opt, double lr);
DDP_API double ddp_optim_get_lr(const ddp_optim_t *opt);
DDP_API const ddp_optim_options_t *ddp_optim_options(const ddp_optim_t *opt);
DDP_API size_t ddp_optim_num_params(const ddp_optim_t *opt);

/* Optimizer state as safetensors with PyTorch's state_dict names: "state.<i>.momentum_buffer"
 * (SGD with momentum), "state.<i>.step" (f32 scalar, as 1.13 stores it), "state.<i>.exp_avg",
 * "state.<i>.exp_avg_sq", "state.<i>.max_exp_avg_sq" (amsgrad). A parameter with no state yet
 * has no entries. Metadata records the kind and hyper-parameters ("optimizer", "lr", ...).
 * Loading checks the kind and every tensor's dtype and shape against the parameters and
 * replaces all state; hyper-parameters stay as created except lr, which is restored (as
 * torch's load_state_dict restores param_groups). A loaded optimizer continues bitwise
 * identically to the one that was saved. */
DDP_API ddp_status_t ddp_optim_save(const ddp_optim_t *opt, const char *path, ddp_error_t *err);
DDP_API ddp_status_t ddp_optim_load(ddp_optim_t *opt, const char *path, ddp_error_t *err);
/* The same with parameter i named state.<index[i]> in the file: a sharded optimizer over
 * some of a group's parameters saves them under the group's indices, and loads its own from
 * a file that holds the whole group (the file's other entries are skipped). */
DDP_API ddp_status_t ddp_optim_save_indexed(const ddp_optim_t *opt, const char *path,
                                            const size_t *index, ddp_error_t *err);
DDP_API ddp_status_t ddp_optim_load_indexed(ddp_optim_t *opt, const char *path, const size_t *index,
                                            ddp_error_t *err);
/* One parameter's state, for sharded checkpoints (src/shard): false when parameter i has
 * none yet; else *step (Adam/AdamW's count; 0 for SGD) and its tensors in ddp_optim_save's
 * key order, t[0] momentum_buffer (SGD) or exp_avg, t[1] exp_avg_sq, t[2] max_exp_avg_sq
 * (amsgrad), NULL where the optimizer keeps none. The tensors stay the optimizer's. */
DDP_API bool ddp_optim_param_state(const ddp_optim_t *opt, size_t i, double *step,
                                   ddp_tensor_t *t[3]);
/* Replaces parameter i's state: none (has_state false), or zeroed tensors at count step,
 * returned in t as ddp_optim_param_state returns them, for the caller to fill. */
DDP_API ddp_status_t ddp_optim_param_state_set(ddp_optim_t *opt, size_t i, bool has_state,
                                               double step, ddp_tensor_t *t[3], ddp_error_t *err);

/* ---------------------------------------------------------------- clipping -------- */

/* torch.nn.utils.clip_grad_norm_ (1.13): total = norm of the per-tensor norms (norm_type 2:
 * L2; norm_type INFINITY: max |g|), computed in the grads' dtype; coef = max_norm /
 * (total + 1e-6) clamped to at most 1; every grad is multiplied by coef (even when it is
 * 1). *total_norm receives the total. NULL-data grads are skipped; with none left the
 * total is 0. error_if_nonfinite: a NaN/Inf total is DDP_ERR_INVALID_DATA and nothing is
 * scaled. All grads must share one dtype (f32 or f64). Per-tensor sums of squares are
 * accumulated in double, so the total may differ from torch's vectorised f32 sum in the
 * last bit; the scaling given the total is exact. */
DDP_API ddp_status_t ddp_clip_grad_norm(ddp_tensor_t *const *grads, size_t n, double max_norm,
                                        double norm_type, bool error_if_nonfinite,
                                        double *total_norm, ddp_error_t *err);

/* Clipping in two halves, for sharded optimizers (src/shard) that hold only some gradients:
 * ddp_grad_norms writes each tensor's L2 norm as ddp_clip_grad_norm computes it (rounded to
 * the grad's dtype, stored as a double; 0 for a NULL-data grad); ddp_clip_grad_norm_from_norms
 * takes all n per-tensor norms (gathered from every shard) and finishes exactly as
 * ddp_clip_grad_norm does: the total from the norms in index order, the coefficient, and
 * every present grad scaled. So a caller that gathers the norms of the full model gets
 * ddp_clip_grad_norm's bits whatever the shards. dt is the grads' dtype (f32 or f64). */
DDP_API void ddp_grad_norms(ddp_tensor_t *const *grads, size_t n, double *norms);
DDP_API void ddp_clip_grad_norm_from_norms(ddp_tensor_t *const *grads, size_t n,
                                           const double *norms, ddp_dtype_t dt, double max_norm,
                                           double *total_norm);
/* Bytes of per-element optimizer state held now (momentum_buffer, exp_avg, exp_avg_sq,
 * max_exp_avg_sq); the per-parameter step counters are not counted. */
DDP_API size_t ddp_optim_state_bytes(const ddp_optim_t *opt);

/* ---------------------------------------------------------------- LR schedules ---- */

/* Hugging Face's SchedulerType names: "constant", "constant_with_warmup", "linear",
 * "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_with_min_lr".
 * Each is a LambdaLR
 * multiplier of the base lr, evaluated at the scheduler's step count (0 before the first
 * optimizer step). */
typedef enum ddp_lr_kind {
  DDP_LR_CONSTANT = 0,
  DDP_LR_CONSTANT_WITH_WARMUP = 1,
  DDP_LR_LINEAR = 2,
  DDP_LR_COSINE = 3,
  DDP_LR_COSINE_WITH_RESTARTS = 4,
  DDP_LR_POLYNOMIAL = 5,
  DDP_LR_INVERSE_SQRT = 6,
  DDP_LR_COSINE_WITH_MIN_LR = 7
} ddp_lr_kind_t;

typedef struct ddp_lr_schedule {
  ddp_lr_kind_t kind;
  int64_t num_warmup_steps;   /* every kind but constant */
  int64_t num_training_steps; /* linear, the cosine kinds, polynomial */
  double num_cycles;          /* cosine, cosine_with_min_lr (HF's default 0.5: half a wave)
                               * and cosine_with_restarts (HF's default 1: set it) */
  double lr_init;             /* polynomial: the optimizer's learning rate (HF reads it from the
                               * optimizer's defaults); must exceed lr_end */
  double lr_end;              /* polynomial; HF's default 1e-7 */
  double power;               /* polynomial; HF's default 1.0 */
  int64_t timescale;          /* inverse_sqrt; 0: HF's default, num_warmup_steps or 10000 */
  double min_lr_rate;         /* cosine_with_min_lr: the floor as a fraction of the base lr
                               * (HF's min_lr_rate, or min_lr / lr) */
} ddp_lr_schedule_t;

#define DDP_LR_SCHEDULE_INIT \
  { DDP_LR_LINEAR, 0, 0, 0.5, 0.0, 1e-7, 1.0, 0, 0.0 }

/* Parses an HF name. DDP_ERR_INVALID_ARGUMENT lists the accepted names. */
DDP_API ddp_status_t ddp_lr_kind_from_name(const char *name, ddp_lr_kind_t *out, ddp_error_t *err);
DDP_API const char *ddp_lr_kind_name(ddp_lr_kind_t kind);
/* Negative step counts are DDP_ERR_INVALID_ARGUMENT; so is num_training_steps < 1 for
 * linear and the cosine kinds (HF requires it), and for polynomial a num_training_steps
 * not above num_warmup_steps (HF divides by their difference) or an lr_init not above
 * lr_end (HF's ValueError). */
DDP_API ddp_status_t ddp_lr_schedule_check(const ddp_lr_schedule_t *s, ddp_error_t *err);
/* The multiplier at scheduler step `step` (transformers' lr_lambda functions). */
DDP_API double ddp_lr_lambda(const ddp_lr_schedule_t *s, int64_t step);
/* base_lr * ddp_lr_lambda(s, step): what LambdaLR puts in the param group. */
DDP_API double ddp_lr_at(const ddp_lr_schedule_t *s, double base_lr, int64_t step);

#ifdef __cplusplus
}
#endif
#endif /* DDP_OPTIM_H */
