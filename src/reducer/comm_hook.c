/* Communication hooks on buckets (§7): registering one (register_comm_hook), calling it on
 * a bucket in place of the allreduce, and resolving the future it returned into the
 * bucket's flat buffer before the copy-back. The hook interface and the future type live
 * in the hooks layer (ddp/hooks.h, src/hooks/comm_work.c).
 *
 * A hook's failure that comes from the process group (a collective timed out, a peer
 * died) has been logged by the group: the reducer adds the hook's name and the bucket to
 * its last error without logging. What the reducer detects about the hook itself (no
 * work returned, a result of the wrong size or dtype) it logs. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* Fills the last error with "DDP: <what>: <msg>", logging it unless the group has failed
 * (then the group has logged the origin). */
static ddp_status_t hook_error(ddp_ddp_t *d, ddp_status_t st, const char *what, const char *msg) {
  if (ddp_pg_status(d->pg) != DDP_OK) return ddp__ddp_carry(d, st, "DDP: %s: %s", what, msg);
  return ddp__ddp_fail(d, st, "[rank %d] DDP: %s: %s", d->rank, what, msg);
}

ddp_status_t ddp__ddp_run_comm_hook(ddp_ddp_t *d, size_t b) {
  ddp__bucket_t *x = &d->buckets[b];
  if (!x->gb_params) {
    x->gb_params = ddp__calloc(x->nvars, sizeof *x->gb_params);
    if (!x->gb_params) return ddp__ddp_oom(d);
    for (size_t k = 0; k < x->nvars; k++) x->gb_params[k] = d->params[x->vars[k]];
  }
  x->gb = (ddp_grad_bucket_t){.index = b,
                              .is_last = b + 1 == d->nbuckets,
                              .buffer = x->buf,
                              .numel = x->numel,
                              .dtype = x->dtype,
                              .nparams = x->nvars,
                              .params = x->gb_params,
                              .offsets = x->offsets};
  ddp_comm_work_t *w = NULL;
  ddp_status_t st = d->comm_hook.fn(d->comm_hook.state, d->pg, &x->gb, &w);
  if (st != DDP_OK) {
    char msg[1024];
    const char *pe = ddp_pg_status(d->pg) != DDP_OK ? ddp__ddp_pg_error(d) : "";
    snprintf(msg, sizeof msg, "%s",
             w && ddp_comm_work_error(w)[0] ? ddp_comm_work_error(w)
             : pe[0]                        ? pe
                                            : ddp_status_str(st));
    ddp_comm_work_free(w);
    char what[512];
    snprintf(what, sizeof what, "comm hook %s failed on bucket %zu", d->comm_hook_name, b);
    return hook_error(d, st, what, msg);
  }
  if (!w)
    return ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                         "[rank %d] DDP: comm hook %s returned no work for bucket %zu", d->rank,
                         d->comm_hook_name, b);
  x->cwork = w;
  return DDP_OK;
}

/* Converts the hook's result (cnt elements of dt at data) into bucket x's buffer in the
 * gradient dtype, through a copy when the two overlap. */
static ddp_status_t convert_result(ddp_ddp_t *d, ddp__bucket_t *x, const void *data,
                                   ddp_dtype_t dt) {
  size_t es = ddp_dtype_size(dt), n = x->numel;
  const char *src = data, *dst = x->buf;
  void *tmp = NULL;
  if (dt != x->dtype && src < dst + n * ddp_dtype_size(x->dtype) && dst < src + n * es) {
    tmp = ddp__malloc(n * es + 1);
    if (!tmp) return ddp__ddp_oom(d);
    data = memcpy(tmp, data, n * es);
  }
  if (dt == x->dtype)
    memmove(x->buf, data, n * es);
  else if (x->dtype == DDP_F64)
    for (size_t i = 0; i < n; i++) ((double *)x->buf)[i] = ddp_dtype_load(data, dt, i);
  else
    for (size_t i = 0; i < n; i++) ((float *)x->buf)[i] = (float)ddp_dtype_load(data, dt, i);
  ddp__free(tmp);
  return DDP_OK;
}

ddp_status_t ddp__ddp_resolve_comm_hook(ddp_ddp_t *d, size_t b, bool report) {
  ddp__bucket_t *x = &d->buckets[b];
  const void *data = NULL;
  size_t cnt = 0;
  ddp_dtype_t dt = x->dtype;
  ddp_status_t st = ddp_comm_work_wait(x->cwork, &data, &cnt, &dt);
  if (st != DDP_OK) {
    if (report) {
      char what[512];
      snprintf(what, sizeof what, "comm hook %s on bucket %zu failed", d->comm_hook_name, b);
      hook_error(d, st, what, ddp_comm_work_error(x->cwork));
    }
  } else if (cnt != x->numel) {
    st = DDP_ERR_INVALID_USAGE;
    if (report)
      ddp__ddp_fail(d, st,
                    "[rank %d] DDP: comm hook %s resolved bucket %zu to a tensor of %zu "
                    "elements, expected %zu (the bucket's element count)",
                    d->rank, d->comm_hook_name, b, cnt, x->numel);
  } else if (dt != DDP_F32 && dt != DDP_F64 && dt != DDP_F16 && dt != DDP_BF16) {
    st = DDP_ERR_INVALID_USAGE;
    if (report)
      ddp__ddp_fail(d, st,
                    "[rank %d] DDP: comm hook %s resolved bucket %zu to dtype %s; expected a "
                    "floating dtype",
                    d->rank, d->comm_hook_name, b, ddp_dtype_name(dt));
  } else if (data != x->buf || dt != x->dtype) {
    st = convert_result(d, x, data, dt);
  }
  ddp_comm_work_free(x->cwork);
  x->cwork = NULL;
  return st;
}

ddp_status_t ddp_ddp_register_comm_hook(ddp_ddp_t *d, const ddp_comm_hook_t *hook,
                                        ddp_error_t *err) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && hook && hook->fn);
  ddp__ddp_error_clear(d);
  ddp_status_t st;
  if (d->inv_k) {
    st = ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                       "[rank %d] DDP: world_size_invariant_shards is on: comm hook %s is refused "
                       "(a hook's compression or its own sum is not invariant to the world size; "
                       "the mode sums with its own reproducible allreduce)",
                       d->rank, hook->name ? hook->name : "comm_hook");
  } else if (d->has_comm_hook) {
    st = ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                       "register_comm_hook or register_builtin_comm_hook can only be called "
                       "once. (rank %d: %s is already registered)",
                       d->rank, d->comm_hook_name);
  } else if (d->num_iterations > 0 || d->require_finalize) {
    st = ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                       "register_comm_hook must be called before the first backward: this DDP "
                       "model has already run %" PRId64 " synchronised iteration(s) (rank %d)",
                       d->num_iterations, d->rank);
  } else {
    const char *name = hook->name ? hook->name : "comm_hook";
    d->comm_hook_name = ddp__strdup(name);
    if (!d->comm_hook_name) {
      st = ddp__ddp_oom(d);
    } else {
      d->comm_hook = *hook;
      d->has_comm_hook = true;
      ddp__log(d->rank, DDP_LOG_INFO, "DDP: registered comm hook %s", name);
      return DDP_OK;
    }
  }
  ddp__ddp_error_copy(d, st, err);
  return st;
}
