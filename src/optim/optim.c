/* SGD, Adam and AdamW with PyTorch 1.13's per-element arithmetic, zero_grad and
 * clip_grad_norm_.
 *
 * How the arithmetic is matched. torch.optim (1.13, foreach=False) runs a few ATen CPU
 * kernels per parameter; each kernel rounds once per element except where its vectorised
 * body fuses a multiply and an add. Measured on Debian's torch 1.13 (tools/torch/optim_oracle.py
 * checks every case bit for bit):
 *   x.add_(y, alpha=a)          -> fma(a, y, x)                 (one rounding)
 *   x.mul_(s)                   -> x * s
 *   x.addcmul_(y, z, value=v)   -> fma(v * y, z, x)             (v*y rounds, then fused)
 *   x.addcdiv_(y, z, value=v)   -> x + (v * y) / z              (three roundings)
 *   x / s (Python scalar s)     -> x / s                        (a true division)
 * Python scalars (lr, 1 - beta, lr / bias_correction1, ...) are computed in double as the
 * optimizer's Python code computes them and converted to the tensor's dtype at the kernel.
 * The compiler must not contract any other a*b+c into an fma, so this file turns
 * floating-point contraction off. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <string.h>

#include "common/common.h"
#include "ddp/optim.h"
#include "optim/optim_internal.h"

#define OPTIM_MAGIC 0x4f50544du /* "OPTM" */

/* ---------------------------------------------------------------- validation ------ */

static ddp_status_t check_options(const ddp_optim_options_t *o, ddp_error_t *err) {
  if (o->kind != DDP_OPTIM_SGD && o->kind != DDP_OPTIM_ADAM && o->kind != DDP_OPTIM_ADAMW)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "optim: unknown optimizer kind %d",
                      (int)o->kind);
  /* torch's constructors: the same conditions and messages. */
  if (!(o->lr >= 0.0))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "optim: Invalid learning rate: %g", o->lr);
  if (!(o->weight_decay >= 0.0))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "optim: Invalid weight_decay value: %g",
                      o->weight_decay);
  if (o->kind == DDP_OPTIM_SGD) {
    if (!(o->momentum >= 0.0))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "optim: Invalid momentum value: %g",
                        o->momentum);
    if (o->nesterov && (o->momentum <= 0.0 || o->dampening != 0.0))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "optim: Nesterov momentum requires a momentum and zero dampening");
    if (!isfinite(o->dampening))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "optim: Invalid dampening value: %g",
                        o->dampening);
  } else {
    if (!(o->eps >= 0.0))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "optim: Invalid epsilon value: %g",
                        o->eps);
    if (!(o->beta1 >= 0.0 && o->beta1 < 1.0))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "optim: Invalid beta parameter at index 0: %g", o->beta1);
    if (!(o->beta2 >= 0.0 && o->beta2 < 1.0))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "optim: Invalid beta parameter at index 1: %g", o->beta2);
  }
  return DDP_OK;
}

static ddp_status_t check_pair(const ddp_optim_param_t *pr, size_t i, ddp_error_t *err) {
  const ddp_tensor_t *p = pr->param, *g = pr->grad;
  if (!p || !g)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "optim: parameter %zu has a NULL %s tensor pointer", i, p ? "grad" : "param");
  if (p->dtype != DDP_F32 && p->dtype != DDP_F64)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "optim: parameter %zu has dtype %s; optimizers take F32 or F64", i,
                      ddp_dtype_name(p->dtype));
  if (!p->data && p->numel > 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "optim: parameter %zu has no data", i);
  if (g->data) {
    if (g->dtype != p->dtype || g->numel != p->numel)
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "optim: parameter %zu is %s[%lld] but its grad is %s[%lld]", i,
                        ddp_dtype_name(p->dtype), (long long)p->numel, ddp_dtype_name(g->dtype),
                        (long long)g->numel);
  }
  return DDP_OK;
}

ddp_status_t ddp_optim_create(const ddp_optim_options_t *opts, const ddp_optim_param_t *params,
                              size_t nparams, ddp_optim_t **out, ddp_error_t *err) {
  DDP_REQUIRE(opts && out);
  DDP_REQUIRE(params || nparams == 0);
  *out = NULL;
  /* An older caller's struct gets the defaults of its kind past its end (AdamW's weight
   * decay differs from SGD's and Adam's). */
  ddp_optim_options_t oo = DDP_SGD_OPTIONS_INIT, w = DDP_ADAMW_OPTIONS_INIT;
  ddp__opts_read(&oo, sizeof oo, opts);
  if (oo.kind == DDP_OPTIM_ADAMW) {
    ddp__opts_read(&w, sizeof w, opts);
    oo = w;
  }
  DDP_CHECK(check_options(&oo, err));
  for (size_t i = 0; i < nparams; i++) DDP_CHECK(check_pair(&params[i], i, err));

  ddp_optim_t *o = ddp__calloc(1, sizeof *o);
  if (!o) return DDP_ERR_NO_MEMORY;
  o->magic = OPTIM_MAGIC;
  o->opts = oo;
  o->n = nparams;
  if (nparams) {
    o->params = ddp__calloc(nparams, sizeof *o->params);
    o->state = ddp__calloc(nparams, sizeof *o->state);
    if (!o->params || !o->state) {
      ddp_optim_destroy(o);
      return DDP_ERR_NO_MEMORY;
    }
    memcpy(o->params, params, nparams * sizeof *params);
    for (size_t i = 0; i < nparams; i++) {
      o->state[i].dtype = params[i].param->dtype;
      o->state[i].numel = params[i].param->numel;
    }
  }
  *out = o;
  return DDP_OK;
}

void ddp__optim_state_clear(ddp_optim_pstate_t *s) {
  ddp_tensor_free(&s->buf);
  ddp_tensor_free(&s->sq);
  ddp_tensor_free(&s->maxsq);
  s->has_state = false;
  s->step = 0.0;
}

void ddp_optim_destroy(ddp_optim_t *opt) {
  if (!opt) return;
  DDP_REQUIRE(opt->magic == OPTIM_MAGIC);
  for (size_t i = 0; opt->state && i < opt->n; i++) ddp__optim_state_clear(&opt->state[i]);
  ddp__free(opt->state);
  ddp__free(opt->params);
  opt->magic = 0;
  ddp__free(opt);
}

void ddp_optim_set_lr(ddp_optim_t *opt, double lr) {
  DDP_REQUIRE(opt && opt->magic == OPTIM_MAGIC);
  opt->opts.lr = lr;
}

double ddp_optim_get_lr(const ddp_optim_t *opt) {
  DDP_REQUIRE(opt && opt->magic == OPTIM_MAGIC);
  return opt->opts.lr;
}

const ddp_optim_options_t *ddp_optim_options(const ddp_optim_t *opt) {
  DDP_REQUIRE(opt && opt->magic == OPTIM_MAGIC);
  return &opt->opts;
}

size_t ddp_optim_num_params(const ddp_optim_t *opt) {
  DDP_REQUIRE(opt && opt->magic == OPTIM_MAGIC);
  return opt->n;
}

void ddp_optim_zero_grad(ddp_optim_t *opt, bool set_to_none) {
  DDP_REQUIRE(opt && opt->magic == OPTIM_MAGIC);
  for (size_t i = 0; i < opt->n; i++) {
    ddp_tensor_t *g = opt->params[i].grad;
    if (!g->data) continue;
    if (set_to_none) {
      /* None keeps the tensor's dtype and shape: the caller's storage (a model's flat
       * gradient buffer) defines it again later. Owned data is freed. */
      ddp_tensor_t hdr = *g;
      ddp_tensor_free(g);
      *g = hdr;
      g->data = NULL;
      g->owns = false;
    } else
      memset(g->data, 0, ddp_tensor_nbytes(g));
  }
}

/* ---------------------------------------------------------------- kernels --------- */

/* torch.maximum propagates NaN from either side; fmax would drop it. */
#define NAN_MAX(T, a, b) (isnan(a) ? (a) : isnan(b) ? (b) : ((a) > (b) ? (a) : (b)))

/* On x86-64 the baseline ISA has no fused multiply-add, so fmaf() is a libm call per element
 * (about 6 ms for one SGD step over 1.9M parameters). Each kernel is therefore also compiled
 * for the FMA extension and picked at load time (DDP_FMA_CLONES). fma is exactly rounded
 * either way, so both clones give the same bits. */

/* One kernel body per dtype: T is float or double, FMA the matching fma. The comments
 * quote the torch 1.13 statement each line reproduces. */
#define DEFINE_SGD(NAME, T, FMA)                                                          \
  DDP_FMA_CLONES static void NAME(const ddp_optim_options_t *o, T *p, const T *g, T *buf, \
                                  bool first, int64_t n) {                                \
    const T wd = (T)o->weight_decay, mom = (T)o->momentum;                                \
    const T damp_alpha = (T)(1.0 - o->dampening), neg_lr = (T)(-o->lr);                   \
    if (!o->maximize && o->weight_decay == 0.0 && o->momentum == 0.0) {                   \
      /* Plain SGD: a branch-free loop the compiler can vectorise. */                     \
      for (int64_t k = 0; k < n; k++) p[k] = FMA(neg_lr, g[k], p[k]);                     \
      return;                                                                             \
    }                                                                                     \
    for (int64_t k = 0; k < n; k++) {                                                     \
      T d = o->maximize ? -g[k] : g[k];                                                   \
      if (o->weight_decay != 0.0) d = FMA(wd, p[k], d); /* d_p.add(param, alpha=wd) */    \
      if (o->momentum != 0.0) {                                                           \
        if (first)                                                                        \
          buf[k] = d; /* buf = clone(d_p) */                                              \
        else                                                                              \
          buf[k] = FMA(damp_alpha, d, buf[k] * mom);    /* buf.mul_(m).add_(d, 1-damp) */ \
        d = o->nesterov ? FMA(mom, buf[k], d) : buf[k]; /* d_p.add(buf, alpha=m) */       \
      }                                                                                   \
      p[k] = FMA(neg_lr, d, p[k]); /* param.add_(d_p, alpha=-lr) */                       \
    }                                                                                     \
  }

DEFINE_SGD(sgd_f32, float, fmaf)
DEFINE_SGD(sgd_f64, double, fma)

/* Adam and AdamW (_single_tensor_adam / _single_tensor_adamw, capturable=False). The
 * scalars step_size = lr / (1 - beta1^t) and sqrt(1 - beta2^t) are Python doubles. */
#define DEFINE_ADAM(NAME, T, FMA, SQRT)                                                            \
  DDP_FMA_CLONES static void NAME(const ddp_optim_options_t *o, bool decoupled, double step, T *p, \
                                  const T *g, T *m, T *v, T *vmax, int64_t n) {                    \
    const double bc1 = 1.0 - pow(o->beta1, step), bc2 = 1.0 - pow(o->beta2, step);                 \
    const double step_size = o->lr / bc1;                                                          \
    const T bc2_sqrt = (T)sqrt(bc2), eps = (T)o->eps, neg_step = (T)(-step_size);                  \
    const T b1 = (T)o->beta1, b2 = (T)o->beta2;                                                    \
    const T one_b1 = (T)(1.0 - o->beta1), one_b2 = (T)(1.0 - o->beta2);                            \
    const T wd = (T)o->weight_decay, decay = (T)(1.0 - o->lr * o->weight_decay);                   \
    if (decoupled && !o->maximize && !o->amsgrad) {                                                \
      /* AdamW's usual case, the loop below without its branches, so that it vectorizes            \
       * (the same operations per element, so the same bits). */                                   \
      for (int64_t k = 0; k < n; k++) {                                                            \
        T gk = g[k], pk = p[k] * decay;                                                            \
        T mk = FMA(one_b1, gk, m[k] * b1), vk = FMA(one_b2 * gk, gk, v[k] * b2);                   \
        m[k] = mk;                                                                                 \
        v[k] = vk;                                                                                 \
        p[k] = pk + (neg_step * mk) / (SQRT(vk) / bc2_sqrt + eps);                                 \
      }                                                                                            \
      return;                                                                                      \
    }                                                                                              \
    for (int64_t k = 0; k < n; k++) {                                                              \
      T gk = o->maximize ? -g[k] : g[k];                                                           \
      if (decoupled)                                                                               \
        p[k] = p[k] * decay; /* param.mul_(1 - lr*wd) */                                           \
      else if (o->weight_decay != 0.0)                                                             \
        gk = FMA(wd, p[k], gk);               /* grad.add(param, alpha=wd) */                      \
      m[k] = FMA(one_b1, gk, m[k] * b1);      /* exp_avg.mul_(b1).add_(g, alpha=1-b1) */           \
      v[k] = FMA(one_b2 * gk, gk, v[k] * b2); /* exp_avg_sq.mul_(b2).addcmul_(g,g,1-b2) */         \
      T s;                                                                                         \
      if (o->amsgrad) {                                                                            \
        vmax[k] = NAN_MAX(T, vmax[k], v[k]);                                                       \
        s = vmax[k];                                                                               \
      } else {                                                                                     \
        s = v[k];                                                                                  \
      }                                                                                            \
      T denom = SQRT(s) / bc2_sqrt + eps;      /* (sq.sqrt() / bc2_sqrt).add_(eps) */              \
      p[k] = p[k] + (neg_step * m[k]) / denom; /* addcdiv_(m, denom, value=-step_size) */          \
    }                                                                                              \
  }

DEFINE_ADAM(adam_f32, float, fmaf, sqrtf)
DEFINE_ADAM(adam_f64, double, fma, sqrt)

ddp_status_t ddp__optim_state_alloc(ddp_optim_t *opt, size_t i) {
  ddp_optim_pstate_t *s = &opt->state[i];
  int64_t shape[1] = {s->numel};
  ddp_status_t st = DDP_OK;
  bool adam = opt->opts.kind != DDP_OPTIM_SGD;
  /* SGD's momentum buffer is created lazily on the first step as a copy of d_p; the
   * Adams start from zeros. */
  DDP_CHECK_GOTO(ddp_tensor_alloc(&s->buf, s->dtype, 1, shape), st, fail);
  if (adam) {
    DDP_CHECK_GOTO(ddp_tensor_alloc(&s->sq, s->dtype, 1, shape), st, fail);
    if (opt->opts.amsgrad)
      DDP_CHECK_GOTO(ddp_tensor_alloc(&s->maxsq, s->dtype, 1, shape), st, fail);
  }
  return DDP_OK;
fail:
  ddp__optim_state_clear(s);
  return st;
}

ddp_status_t ddp_optim_step(ddp_optim_t *opt, ddp_error_t *err) {
  DDP_REQUIRE(opt && opt->magic == OPTIM_MAGIC);
  const ddp_optim_options_t *o = &opt->opts;
  for (size_t i = 0; i < opt->n; i++) {
    ddp_tensor_t *p = opt->params[i].param, *g = opt->params[i].grad;
    ddp_optim_pstate_t *s = &opt->state[i];
    if (!g->data) continue; /* grad is None: torch skips the parameter entirely */
    if (p->dtype != s->dtype || p->numel != s->numel || g->dtype != s->dtype ||
        g->numel != s->numel || (!p->data && p->numel > 0))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "optim: parameter %zu changed since create: expected %s[%lld], param "
                        "is %s[%lld], grad is %s[%lld]",
                        i, ddp_dtype_name(s->dtype), (long long)s->numel, ddp_dtype_name(p->dtype),
                        (long long)p->numel, ddp_dtype_name(g->dtype), (long long)g->numel);
    bool f32 = s->dtype == DDP_F32;
    if (o->kind == DDP_OPTIM_SGD) {
      bool first = false;
      if (o->momentum != 0.0 && !s->has_state) {
        DDP_CHECK(ddp__optim_state_alloc(opt, i));
        s->has_state = true;
        first = true;
      }
      if (f32)
        sgd_f32(o, p->data, g->data, s->buf.data, first, s->numel);
      else
        sgd_f64(o, p->data, g->data, s->buf.data, first, s->numel);
    } else {
      if (!s->has_state) {
        DDP_CHECK(ddp__optim_state_alloc(opt, i));
        s->has_state = true;
        s->step = 0.0;
      }
      /* state['step'] is an f32 tensor in 1.13; step_t += 1 rounds in f32. */
      s->step = (double)(float)(s->step + 1.0);
      bool decoupled = o->kind == DDP_OPTIM_ADAMW;
      if (f32)
        adam_f32(o, decoupled, s->step, p->data, g->data, s->buf.data, s->sq.data,
                 o->amsgrad ? s->maxsq.data : NULL, s->numel);
      else
        adam_f64(o, decoupled, s->step, p->data, g->data, s->buf.data, s->sq.data,
                 o->amsgrad ? s->maxsq.data : NULL, s->numel);
    }
  }
  return DDP_OK;
}

/* ---------------------------------------------------------------- clipping -------- */

/* torch 1.13 clip_grad_norm_: per-tensor norms are 0-d tensors in the grads' dtype, the
 * total is the same norm of their stack, and the scale is computed with tensor ops:
 * max_norm / (total + 1e-6) is Tensor.__rtruediv__, i.e. reciprocal(total + 1e-6) *
 * max_norm, each rounding in the dtype; clamp(max=1) keeps NaN. */
#define DEFINE_CLIP(NAME, T)                                                             \
  static void NAME(ddp_tensor_t *const *grads, size_t n, double max_norm, bool inf_norm, \
                   T *total_out) {                                                       \
    double total_acc = 0.0;                                                              \
    T total_max = 0;                                                                     \
    bool any = false;                                                                    \
    for (size_t i = 0; i < n; i++) {                                                     \
      const ddp_tensor_t *g = grads[i];                                                  \
      if (!g->data) continue;                                                            \
      const T *x = g->data;                                                              \
      if (inf_norm) {                                                                    \
        T m = 0;                                                                         \
        for (int64_t k = 0; k < g->numel; k++) {                                         \
          T a = (T)fabs((double)x[k]);                                                   \
          if (isnan(a) || a > m) m = a;                                                  \
          if (isnan(m)) break;                                                           \
        }                                                                                \
        if (!any || isnan(m) || m > total_max) total_max = m;                            \
      } else {                                                                           \
        double acc = 0.0;                                                                \
        for (int64_t k = 0; k < g->numel; k++) acc += (double)x[k] * (double)x[k];       \
        T norm = (T)sqrt(acc);                                                           \
        total_acc += (double)norm * (double)norm;                                        \
      }                                                                                  \
      any = true;                                                                        \
    }                                                                                    \
    T total = inf_norm ? total_max : (T)sqrt(total_acc);                                 \
    *total_out = total;                                                                  \
    if (!any) return;                                                                    \
    T denom = total + (T)1e-6;                                                           \
    T coef = ((T)1 / denom) * (T)max_norm;                                               \
    if (coef > (T)1) coef = (T)1;                                                        \
    for (size_t i = 0; i < n; i++) {                                                     \
      const ddp_tensor_t *g = grads[i];                                                  \
      if (!g->data) continue;                                                            \
      T *x = g->data;                                                                    \
      for (int64_t k = 0; k < g->numel; k++) x[k] = x[k] * coef;                         \
    }                                                                                    \
  }

DEFINE_CLIP(clip_f32, float)
DEFINE_CLIP(clip_f64, double)

ddp_status_t ddp_clip_grad_norm(ddp_tensor_t *const *grads, size_t n, double max_norm,
                                double norm_type, bool error_if_nonfinite, double *total_norm,
                                ddp_error_t *err) {
  DDP_REQUIRE(grads || n == 0);
  bool inf_norm = isinf(norm_type) && norm_type > 0;
  if (!inf_norm && norm_type != 2.0)
    return ddp__error(err, -1, DDP_ERR_UNSUPPORTED,
                      "clip_grad_norm: norm_type %g is not supported (2 or INFINITY)", norm_type);
  ddp_dtype_t dt = DDP_F32;
  bool have = false;
  for (size_t i = 0; i < n; i++) {
    DDP_REQUIRE(grads[i]);
    if (!grads[i]->data) continue;
    if (grads[i]->dtype != DDP_F32 && grads[i]->dtype != DDP_F64)
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "clip_grad_norm: grad %zu has dtype %s; F32 or F64 expected", i,
                        ddp_dtype_name(grads[i]->dtype));
    if (have && grads[i]->dtype != dt)
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "clip_grad_norm: grad %zu is %s but earlier grads are %s", i,
                        ddp_dtype_name(grads[i]->dtype), ddp_dtype_name(dt));
    dt = grads[i]->dtype;
    have = true;
  }
  double total = 0.0;
  if (error_if_nonfinite && have) {
    /* Compute the total without scaling first, so a non-finite total changes nothing. */
    double probe = 0.0;
    for (size_t i = 0; i < n; i++) {
      const ddp_tensor_t *g = grads[i];
      if (!g->data) continue;
      for (int64_t k = 0; k < g->numel; k++) {
        double x = dt == DDP_F32 ? ((const float *)g->data)[k] : ((const double *)g->data)[k];
        probe += x * x;
      }
    }
    if (!isfinite(probe) || (dt == DDP_F32 && !isfinite((float)sqrt(probe)))) {
      if (total_norm) *total_norm = sqrt(probe);
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "clip_grad_norm: The total norm of order %g for gradients is "
                        "non-finite, so it cannot be clipped (error_if_nonfinite=true)",
                        norm_type);
    }
  }
  if (dt == DDP_F32) {
    float t;
    clip_f32(grads, n, max_norm, inf_norm, &t);
    total = t;
  } else {
    double t;
    clip_f64(grads, n, max_norm, inf_norm, &t);
    total = t;
  }
  if (total_norm) *total_norm = total;
  return DDP_OK;
}

/* ---------------------------------------------------------------- sharded clipping  */

#define DEFINE_NORMS(NAME, T)                                                  \
  static void NAME(const ddp_tensor_t *g, double *norm) {                      \
    const T *x = g->data;                                                      \
    double acc = 0.0;                                                          \
    for (int64_t k = 0; k < g->numel; k++) acc += (double)x[k] * (double)x[k]; \
    *norm = (double)(T)sqrt(acc);                                              \
  }
DEFINE_NORMS(norm_f32, float)
DEFINE_NORMS(norm_f64, double)

void ddp_grad_norms(ddp_tensor_t *const *grads, size_t n, double *norms) {
  DDP_REQUIRE((grads && norms) || n == 0);
  for (size_t i = 0; i < n; i++) {
    norms[i] = 0.0;
    if (!grads[i]->data) continue;
    DDP_REQUIRE(grads[i]->dtype == DDP_F32 || grads[i]->dtype == DDP_F64);
    if (grads[i]->dtype == DDP_F32)
      norm_f32(grads[i], &norms[i]);
    else
      norm_f64(grads[i], &norms[i]);
  }
}

/* The second half of DEFINE_CLIP (2-norm): the same roundings, from the per-tensor norms. */
#define DEFINE_CLIP_FROM(NAME, T)                                                                  \
  static double NAME(ddp_tensor_t *const *grads, size_t n, const double *norms, double max_norm) { \
    double total_acc = 0.0;                                                                        \
    for (size_t i = 0; i < n; i++) {                                                               \
      T norm = (T)norms[i];                                                                        \
      total_acc += (double)norm * (double)norm;                                                    \
    }                                                                                              \
    T total = (T)sqrt(total_acc);                                                                  \
    T denom = total + (T)1e-6;                                                                     \
    T coef = ((T)1 / denom) * (T)max_norm;                                                         \
    if (coef > (T)1) coef = (T)1;                                                                  \
    for (size_t i = 0; i < n; i++) {                                                               \
      if (!grads[i]->data) continue;                                                               \
      T *x = grads[i]->data;                                                                       \
      for (int64_t k = 0; k < grads[i]->numel; k++) x[k] = x[k] * coef;                            \
    }                                                                                              \
    return (double)total;                                                                          \
  }
DEFINE_CLIP_FROM(clip_from_f32, float)
DEFINE_CLIP_FROM(clip_from_f64, double)

void ddp_clip_grad_norm_from_norms(ddp_tensor_t *const *grads, size_t n, const double *norms,
                                   ddp_dtype_t dt, double max_norm, double *total_norm) {
  DDP_REQUIRE(((grads && norms) || n == 0) && (dt == DDP_F32 || dt == DDP_F64));
  double t = dt == DDP_F32 ? clip_from_f32(grads, n, norms, max_norm)
                           : clip_from_f64(grads, n, norms, max_norm);
  if (total_norm) *total_norm = t;
}

size_t ddp_optim_state_bytes(const ddp_optim_t *opt) {
  DDP_REQUIRE(opt && opt->magic == OPTIM_MAGIC);
  size_t b = 0;
  for (size_t i = 0; i < opt->n; i++) {
    const ddp_optim_pstate_t *s = &opt->state[i];
    if (!s->has_state) continue;
    const ddp_tensor_t *ts[3] = {&s->buf, &s->sq, &s->maxsq};
    for (int k = 0; k < 3; k++)
      if (ts[k]->data) b += (size_t)ts[k]->numel * ddp_dtype_size(ts[k]->dtype);
  }
  return b;
}
